// CUDA kernels for Zen's hash partitioning; same contract as zen_cpu.cpp and the PyTorch references.
//
// The paper writes indices in parallel into per-partition hash memory (a probed parallel region,
// a serial overflow region behind an atomic counter, a read-after-write check so nothing is lost).
// That design avoids a sort but leaves each partition in a racy order. Here the equivalent is a
// two-pass counting sort: pass 1 counts, per tile of the input, how many indices each server gets;
// an exclusive scan turns the counts into exact output offsets; pass 2 writes every pair straight
// to its final slot. Nothing can overflow or be lost (sizes are exact), and ranks inside a tile come
// from warp votes in lane order, so the output is deterministic and equal to the stable CPU order.
//
// Plain CUDA C++ for NVRTC: ddlscale/sync/sparse/cuda_ops.py compiles this file at run time through
// cupy (with zen_hash.h inlined), so it includes no torch and no standard-library header, and every
// entry point is extern "C" under the name the loader asks for (cuda_ops.KERNELS). The loader picks
// the launch geometry, allocates with torch and runs the scan between the two passes.
// __match_any_sync needs compute capability 7.0 or newer.
#include "zen_hash.h"

using zen::i64;
using zen::u64;

namespace {

constexpr int kWarp = 32;

__device__ __forceinline__ i64 lesser(i64 a, i64 b) { return a < b ? a : b; }

// The server an item goes to: hashed from its index (partition) or read from given ids (grouping).
struct Owner {
  const i64* key;  // the indices when hashed, else the server ids
  u64 seed;
  zen::Mod63 mod;
  int hashed;
  __device__ i64 operator()(i64 i) const { return hashed ? zen::owner(key[i], seed, mod) : key[i]; }
};

// Values move as raw rows: one word per row when the row is 1, 2, 4 or 8 aligned bytes, else bytewise.
template <typename Word>
struct WordRows {
  const Word* in;
  Word* out;
  __device__ void move(i64 from, i64 to) const { out[to] = in[from]; }
};

struct ByteRows {
  const unsigned char* in;
  unsigned char* out;
  i64 width;
  __device__ void move(i64 from, i64 to) const {
    for (i64 b = 0; b < width; ++b) out[to * width + b] = in[from * width + b];
  }
};

// Pass 2: the warp's cursor for server s starts at its exclusive offset; a lane's slot is the cursor
// plus the number of lower lanes with the same server, then the leader advances the cursor.
template <typename Rows>
__device__ void scatter(Owner owner, const i64* idx, Rows rows, i64 n, i64 tile, i64 tiles, int servers,
                        const i64* offsets, i64* idx_out, i64* cursors) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const i64 t = blockIdx.x * i64(blockDim.x / kWarp) + warp;
  if (t >= tiles) return;  // whole warps leave together
  i64* cursor = cursors + warp * servers;
  for (int s = lane; s < servers; s += kWarp) cursor[s] = offsets[i64(s) * tiles + t];
  __syncwarp();
  const unsigned lower = (1u << lane) - 1;
  const i64 end = lesser(n, (t + 1) * tile);
  for (i64 base = t * tile; base < end; base += kWarp) {
    const i64 i = base + lane;
    const int s = i < end ? int(owner(i)) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, s);
    if (s >= 0) {
      const i64 slot = cursor[s] + __popc(peers & lower);
      idx_out[slot] = idx[i];
      rows.move(i, slot);
    }
    __syncwarp();  // every lane has read cursor[s] before its leader moves it
    if (s >= 0 && lane == __ffs(peers) - 1) cursor[s] += __popc(peers);
    __syncwarp();
  }
}

}  // namespace

extern "C" __global__ void zen_server_of(const i64* indices, u64 seed, u64 d, u64 magic, int shift, i64* out,
                                         i64 n) {
  const zen::Mod63 mod(d, magic, shift);
  for (i64 i = blockIdx.x * i64(blockDim.x) + threadIdx.x; i < n; i += i64(gridDim.x) * blockDim.x)
    out[i] = zen::owner(indices[i], seed, mod);
}

// Pass 1: every warp owns one tile of `tile` consecutive items and, in shared memory, one counter per
// server. Each round it takes 32 items; lanes with the same server find each other with
// __match_any_sync and the lowest of them (the leader) adds the group's size. hist is (servers, tiles).
extern "C" __global__ void zen_count(const i64* key, int hashed, u64 seed, u64 d, u64 magic, int shift, i64 n,
                                     i64 tile, i64 tiles, int servers, i64* hist) {
  extern __shared__ int counters[];
  const Owner owner{key, seed, zen::Mod63(d, magic, shift), hashed};
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const i64 t = blockIdx.x * i64(blockDim.x / kWarp) + warp;
  if (t >= tiles) return;
  int* count = counters + warp * servers;
  for (int s = lane; s < servers; s += kWarp) count[s] = 0;
  __syncwarp();
  const i64 end = lesser(n, (t + 1) * tile);
  for (i64 base = t * tile; base < end; base += kWarp) {
    const i64 i = base + lane;
    const int s = i < end ? int(owner(i)) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, s);
    if (s >= 0 && lane == __ffs(peers) - 1) count[s] += __popc(peers);
    __syncwarp();
  }
  for (int s = lane; s < servers; s += kWarp) hist[i64(s) * tiles + t] = count[s];
}

// Pass 2, one entry point per row width; all take the same arguments (width is read by the bytewise one).
#define ZEN_SCATTER_ARGS                                                                                       \
  const i64 *key, int hashed, u64 seed, u64 d, u64 magic, int shift, const i64 *idx, const void *in, void *out, \
      i64 width, i64 n, i64 tile, i64 tiles, int servers, const i64 *offsets, i64 *idx_out
#define ZEN_SCATTER_BODY(ROWS)                                                                                   \
  extern __shared__ i64 cursors[];                                                                               \
  scatter(Owner{key, seed, zen::Mod63(d, magic, shift), hashed}, idx, ROWS, n, tile, tiles, servers, offsets, \
          idx_out, cursors)

extern "C" __global__ void zen_scatter_1(ZEN_SCATTER_ARGS) {
  ZEN_SCATTER_BODY((WordRows<unsigned char>{static_cast<const unsigned char*>(in), static_cast<unsigned char*>(out)}));
}
extern "C" __global__ void zen_scatter_2(ZEN_SCATTER_ARGS) {
  ZEN_SCATTER_BODY(
      (WordRows<unsigned short>{static_cast<const unsigned short*>(in), static_cast<unsigned short*>(out)}));
}
extern "C" __global__ void zen_scatter_4(ZEN_SCATTER_ARGS) {
  ZEN_SCATTER_BODY((WordRows<unsigned int>{static_cast<const unsigned int*>(in), static_cast<unsigned int*>(out)}));
}
extern "C" __global__ void zen_scatter_8(ZEN_SCATTER_ARGS) {
  ZEN_SCATTER_BODY((WordRows<u64>{static_cast<const u64*>(in), static_cast<u64*>(out)}));
}
extern "C" __global__ void zen_scatter_bytes(ZEN_SCATTER_ARGS) {
  ZEN_SCATTER_BODY((ByteRows{static_cast<const unsigned char*>(in), static_cast<unsigned char*>(out), width}));
}

// One element per thread; a warp's ballot is 4 bitmap bytes (bit i = lane i: little-endian order).
// The loader launches whole blocks of a multiple of 32 threads, so every lane of a warp takes part.
extern "C" __global__ void zen_pack_bits(const unsigned char* mask, unsigned char* out, i64 n, i64 bytes) {
  const i64 i = blockIdx.x * i64(blockDim.x) + threadIdx.x;
  const unsigned word = __ballot_sync(0xffffffffu, i < n && mask[i] != 0);
  const int lane = threadIdx.x % kWarp;
  const i64 byte = (i - lane) / 8 + lane;
  if (lane < 4 && byte < bytes) out[byte] = (unsigned char)(word >> (8 * lane));
}

extern "C" __global__ void zen_unpack_bits(const unsigned char* bitmap, unsigned char* out, i64 n) {
  for (i64 i = blockIdx.x * i64(blockDim.x) + threadIdx.x; i < n; i += i64(gridDim.x) * blockDim.x)
    out[i] = (bitmap[i >> 3] >> (i & 7)) & 1;
}
