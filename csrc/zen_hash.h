// h0 of Zen's hash partition, shared by the C++ and CUDA kernels so both agree bit for bit with
// ddlscale.sync.sparse.hashing (fmix64 of index ^ seed, top bit cleared, modulo the server count).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ZEN_HD __host__ __device__ __forceinline__
#else
#define ZEN_HD inline
#endif

namespace zen {

// MurmurHash3's 64-bit finalizer: full avalanche, so clustered indices spread over all servers.
ZEN_HD uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

ZEN_HD uint64_t mul_high(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

// x % d for x < 2^63 without a 64-bit division (tens of cycles on CPUs, emulated on GPUs).
// Granlund-Montgomery: with l = ceil(log2 d) and m = ceil(2^(63+l) / d), m*d - 2^(63+l) < d <= 2^l,
// which makes floor(x*m / 2^(63+l)) == x / d for every x < 2^63. Powers of two take a mask.
struct Mod63 {
  uint64_t d = 1, mask = 0, magic = 0;
  int shift = 0;  // (x*m) >> (63+l) == mul_high(x, m) >> (l-1)
  bool power_of_two = true;

  Mod63() = default;
  explicit Mod63(uint64_t divisor) : d(divisor) {
    power_of_two = (d & (d - 1)) == 0;
    mask = d - 1;
    if (power_of_two) return;
    int l = 0;
    while ((uint64_t(1) << l) < d) ++l;  // d >= 3 here, so 2 <= l <= 63
    // ceil(2^(63+l) / d) < 2^64 because d > 2^(l-1); computed in 128 bits.
    unsigned __int128 numerator = static_cast<unsigned __int128>(1) << (63 + l);
    magic = static_cast<uint64_t>((numerator + d - 1) / d);
    shift = l - 1;
  }

  ZEN_HD uint64_t operator()(uint64_t x) const {
    if (power_of_two) return x & mask;
    return x - (mul_high(x, magic) >> shift) * d;
  }
};

ZEN_HD int64_t owner(int64_t index, uint64_t seed, const Mod63& mod) {
  return static_cast<int64_t>(mod(fmix64(static_cast<uint64_t>(index) ^ seed) & 0x7fffffffffffffffULL));
}

}  // namespace zen
