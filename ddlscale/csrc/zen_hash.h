// h0 of Zen's hash partition, shared by the C++ kernels (zen_cpu.cpp) and the CUDA kernels
// (zen_cuda.cu) so both agree bit for bit with ddlscale.sync.sparse.kernels.server_of_reference
// (fmix64 of index ^ seed, top bit cleared, modulo the server count).
//
// NVRTC compiles zen_cuda.cu at run time with no C++ standard library, so this header includes
// nothing and names its integer types itself; the divider's magic numbers are then computed on the
// host (ddlscale.sync.sparse.cuda_ops.divider) and handed to the kernels.
#pragma once

#if defined(__CUDACC_RTC__)
#define ZEN_HD __device__ __forceinline__
#elif defined(__CUDACC__)
#define ZEN_HD __host__ __device__ __forceinline__
#else
#define ZEN_HD inline
#endif

namespace zen {

using u64 = unsigned long long;
using i64 = long long;

// MurmurHash3's 64-bit finalizer: full avalanche, so clustered indices spread over all servers.
ZEN_HD u64 fmix64(u64 k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

ZEN_HD u64 mul_high(u64 a, u64 b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  return static_cast<u64>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

// x % d for x < 2^63 without a 64-bit division (tens of cycles on CPUs, emulated on GPUs).
// Granlund-Montgomery: with l = ceil(log2 d) and m = ceil(2^(63+l) / d), m*d - 2^(63+l) < d <= 2^l,
// which makes floor(x*m / 2^(63+l)) == x / d for every x < 2^63. Powers of two take a mask, marked
// by magic == 0 (for any other d, m >= 2^63).
struct Mod63 {
  u64 d = 1, magic = 0;
  int shift = 0;  // (x*m) >> (63+l) == mul_high(x, m) >> (l-1)

  Mod63() = default;
  ZEN_HD Mod63(u64 divisor, u64 magic_number, int shift_bits) : d(divisor), magic(magic_number), shift(shift_bits) {}
#if !defined(__CUDACC_RTC__)
  explicit Mod63(u64 divisor) : d(divisor) {
    if ((d & (d - 1)) == 0) return;
    int l = 0;
    while ((u64(1) << l) < d) ++l;  // d >= 3 here, so 2 <= l <= 63
    // ceil(2^(63+l) / d) < 2^64 because d > 2^(l-1); computed in 128 bits.
    const unsigned __int128 numerator = static_cast<unsigned __int128>(1) << (63 + l);
    magic = static_cast<u64>((numerator + d - 1) / d);
    shift = l - 1;
  }
#endif

  ZEN_HD u64 operator()(u64 x) const {
    if (magic == 0) return x & (d - 1);
    return x - (mul_high(x, magic) >> shift) * d;
  }
};

ZEN_HD i64 owner(i64 index, u64 seed, const Mod63& mod) {
  return static_cast<i64>(mod(fmix64(static_cast<u64>(index) ^ seed) & 0x7fffffffffffffffULL));
}

}  // namespace zen
