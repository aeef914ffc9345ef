// CUDA kernels for Zen's hash partitioning; same contract as zen_cpu.cpp and the PyTorch references.
//
// The paper writes indices in parallel into per-partition hash memory (a probed parallel region,
// a serial overflow region behind an atomic counter, a read-after-write check so nothing is lost).
// That design avoids a sort but leaves each partition in a racy order. Here the equivalent is a
// two-pass counting sort: pass 1 counts, per tile of the input, how many indices each server gets;
// an exclusive scan turns the counts into exact output offsets; pass 2 writes every pair straight
// to its final slot. Nothing can overflow or be lost (sizes are exact), and ranks inside a tile come
// from warp votes in lane order, so the output is deterministic and equal to the stable CPU order.
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "zen_hash.h"

namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr int64_t kMaxServers = 4096;  // per-warp counters live in shared memory
constexpr int64_t kSharedCursors = 6144;  // int64 cursors per block: 48 KiB, the default shared-memory limit

int64_t blocks_for(int64_t work, int64_t per_block) {
  return std::max<int64_t>(1, std::min<int64_t>((work + per_block - 1) / per_block, 1 << 30));
}

struct HashOwner {
  const int64_t* indices;
  uint64_t seed;
  zen::Mod63 mod;
  __device__ int64_t operator()(int64_t i) const { return zen::owner(indices[i], seed, mod); }
};

struct GivenOwner {
  const int64_t* server;
  __device__ int64_t operator()(int64_t i) const { return server[i]; }
};

__global__ void server_of_kernel(HashOwner owner, int64_t* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = owner(i);
}

// Every warp owns one tile of `tile` consecutive items and, in shared memory, one counter per
// server. Each round it takes 32 items; lanes with the same server find each other with
// __match_any_sync and the lowest of them (the leader) adds the group's size.
template <typename Owner>
__global__ void count_kernel(Owner owner, int64_t n, int64_t tile, int64_t tiles, int servers, int64_t* hist) {
  extern __shared__ int counters[];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t t = blockIdx.x * int64_t(blockDim.x / kWarp) + warp;
  if (t >= tiles) return;  // whole warps leave together
  int* count = counters + warp * servers;
  for (int s = lane; s < servers; s += kWarp) count[s] = 0;
  __syncwarp();
  const int64_t end = min(n, (t + 1) * tile);
  for (int64_t base = t * tile; base < end; base += kWarp) {
    const int64_t i = base + lane;
    const int s = i < end ? int(owner(i)) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, s);
    if (s >= 0 && lane == __ffs(peers) - 1) count[s] += __popc(peers);
    __syncwarp();
  }
  for (int s = lane; s < servers; s += kWarp) hist[int64_t(s) * tiles + t] = count[s];
}

template <typename Word>
struct WordRows {
  const Word* in;
  Word* out;
  __device__ void move(int64_t from, int64_t to) const { out[to] = in[from]; }
};
struct ByteRows {
  const uint8_t* in;
  uint8_t* out;
  int64_t width;
  __device__ void move(int64_t from, int64_t to) const {
    for (int64_t b = 0; b < width; ++b) out[to * width + b] = in[from * width + b];
  }
};

// Pass 2: the warp's cursor for server s starts at its exclusive offset; a lane's slot is the cursor
// plus the number of lower lanes with the same server, then the leader advances the cursor.
template <typename Owner, typename Rows>
__global__ void scatter_kernel(Owner owner, const int64_t* idx, Rows rows, int64_t n, int64_t tile, int64_t tiles,
                               int servers, const int64_t* offsets, int64_t* idx_out) {
  extern __shared__ int64_t cursors[];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t t = blockIdx.x * int64_t(blockDim.x / kWarp) + warp;
  if (t >= tiles) return;
  int64_t* cursor = cursors + warp * servers;
  for (int s = lane; s < servers; s += kWarp) cursor[s] = offsets[int64_t(s) * tiles + t];
  __syncwarp();
  const unsigned lower = (1u << lane) - 1;
  const int64_t end = min(n, (t + 1) * tile);
  for (int64_t base = t * tile; base < end; base += kWarp) {
    const int64_t i = base + lane;
    const int s = i < end ? int(owner(i)) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, s);
    if (s >= 0) {
      const int64_t slot = cursor[s] + __popc(peers & lower);
      idx_out[slot] = idx[i];
      rows.move(i, slot);
    }
    __syncwarp();  // every lane has read cursor[s] before its leader moves it
    if (s >= 0 && lane == __ffs(peers) - 1) cursor[s] += __popc(peers);
    __syncwarp();
  }
}

template <typename F>
void with_rows(const at::Tensor& src, at::Tensor& dst, int64_t rows, F f) {
  const int64_t width = rows ? src.numel() / rows * src.element_size() : 0;
  auto in = static_cast<const uint8_t*>(src.data_ptr());
  auto out = static_cast<uint8_t*>(dst.data_ptr());
  const auto aligned = [&](int64_t w) {
    return width == w && reinterpret_cast<uintptr_t>(in) % w == 0 && reinterpret_cast<uintptr_t>(out) % w == 0;
  };
  if (aligned(1)) return f(WordRows<uint8_t>{in, out});
  if (aligned(2)) return f(WordRows<uint16_t>{reinterpret_cast<const uint16_t*>(in), reinterpret_cast<uint16_t*>(out)});
  if (aligned(4)) return f(WordRows<uint32_t>{reinterpret_cast<const uint32_t*>(in), reinterpret_cast<uint32_t*>(out)});
  if (aligned(8)) return f(WordRows<uint64_t>{reinterpret_cast<const uint64_t*>(in), reinterpret_cast<uint64_t*>(out)});
  return f(ByteRows{in, out, width});
}

at::Tensor check_indices(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda(), what, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == at::kLong, what, " must be int64, got ", t.scalar_type());
  return t.reshape(-1).contiguous();
}

template <typename Owner>
std::tuple<at::Tensor, at::Tensor, at::Tensor> group(Owner owner, const at::Tensor& idx, const at::Tensor& values,
                                                     int64_t servers) {
  TORCH_CHECK(servers >= 1 && servers <= kMaxServers, "num_servers must lie in [1, ", kMaxServers, "], got ",
              servers);
  const int64_t n = idx.numel();
  TORCH_CHECK(values.is_cuda() && values.dim() >= 1 && values.size(0) == n,
              "values must be a CUDA tensor with one row per index");
  const at::Tensor vals = values.contiguous();
  at::Tensor idx_out = at::empty_like(idx), val_out = at::empty_like(vals);
  // Tiles of >= 32 rounds, longer with many servers, so the per-tile counts stay ~n/32 in all.
  const int64_t tile = kWarp * std::max<int64_t>(32, servers);
  const int64_t tiles = std::max<int64_t>(1, (n + tile - 1) / tile);
  const int warps = int(std::max<int64_t>(1, std::min<int64_t>(kThreads / kWarp, kSharedCursors / servers)));
  const int64_t blocks = (tiles + warps - 1) / warps;
  at::Tensor hist = at::empty({servers, tiles}, idx.options());
  auto stream = c10::cuda::getCurrentCUDAStream();
  count_kernel<<<blocks, warps * kWarp, warps * servers * sizeof(int), stream>>>(owner, n, tile, tiles, int(servers),
                                                                                 hist.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor flat = hist.view(-1);
  const at::Tensor offsets = flat.cumsum(0) - flat;  // exclusive, in (server, tile) order
  const at::Tensor counts = hist.sum(1);
  with_rows(vals, val_out, n, [&](auto rows) {
    scatter_kernel<<<blocks, warps * kWarp, warps * servers * sizeof(int64_t), stream>>>(
        owner, idx.data_ptr<int64_t>(), rows, n, tile, tiles, int(servers), offsets.data_ptr<int64_t>(),
        idx_out.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {idx_out, val_out, counts};
}

__global__ void pack_bits_kernel(const bool* mask, uint8_t* out, int64_t n, int64_t bytes) {
  // One element per thread; a warp's ballot is 4 bitmap bytes (bit i = lane i: little-endian order).
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const unsigned word = __ballot_sync(0xffffffffu, i < n && mask[i]);
  const int lane = threadIdx.x % kWarp;
  const int64_t byte = (i - lane) / 8 + lane;
  if (lane < 4 && byte < bytes) out[byte] = uint8_t(word >> (8 * lane));
}

__global__ void unpack_bits_kernel(const uint8_t* bitmap, bool* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = (bitmap[i >> 3] >> (i & 7)) & 1;
}

}  // namespace

at::Tensor server_of(const at::Tensor& indices, int64_t seed, int64_t num_servers) {
  TORCH_CHECK(num_servers >= 1, "num_servers must be >= 1, got ", num_servers);
  const c10::cuda::CUDAGuard guard(indices.device());
  const auto idx = check_indices(indices, "indices");
  at::Tensor out = at::empty_like(idx);
  const HashOwner owner{idx.data_ptr<int64_t>(), uint64_t(seed), zen::Mod63(uint64_t(num_servers))};
  if (idx.numel()) {
    server_of_kernel<<<blocks_for(idx.numel(), kThreads), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        owner, out.data_ptr<int64_t>(), idx.numel());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out.view(indices.sizes());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> partition(const at::Tensor& indices, const at::Tensor& values,
                                                         int64_t seed, int64_t num_servers) {
  TORCH_CHECK(num_servers >= 1, "num_servers must be >= 1, got ", num_servers);
  const c10::cuda::CUDAGuard guard(indices.device());
  const auto idx = check_indices(indices, "indices");
  const HashOwner owner{idx.data_ptr<int64_t>(), uint64_t(seed), zen::Mod63(uint64_t(num_servers))};
  return group(owner, idx, values, num_servers);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_by_server(const at::Tensor& server, const at::Tensor& indices,
                                                               const at::Tensor& values, int64_t num_servers) {
  const c10::cuda::CUDAGuard guard(indices.device());
  const auto own = check_indices(server, "server");
  const auto idx = check_indices(indices, "indices");
  TORCH_CHECK(idx.numel() == own.numel(), "one server id per index");
  if (own.numel()) {
    auto [lo, hi] = at::aminmax(own);
    TORCH_CHECK(lo.item<int64_t>() >= 0 && hi.item<int64_t>() < num_servers, "server ids must lie in [0, ",
                num_servers, ")");
  }
  return group(GivenOwner{own.data_ptr<int64_t>()}, idx, values, num_servers);
}

at::Tensor pack_bits(const at::Tensor& mask) {
  TORCH_CHECK(mask.is_cuda() && mask.scalar_type() == at::kBool, "mask must be a CUDA bool tensor");
  const c10::cuda::CUDAGuard guard(mask.device());
  const auto m = mask.reshape(-1).contiguous();
  const int64_t n = m.numel(), bytes = (n + 7) / 8;
  at::Tensor out = at::empty({bytes}, m.options().dtype(at::kByte));
  if (n) {
    pack_bits_kernel<<<(n + kThreads - 1) / kThreads, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        m.data_ptr<bool>(), out.data_ptr<uint8_t>(), n, bytes);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

at::Tensor unpack_bits(const at::Tensor& bitmap, int64_t length) {
  TORCH_CHECK(bitmap.is_cuda() && bitmap.scalar_type() == at::kByte, "bitmap must be a CUDA uint8 tensor");
  TORCH_CHECK(length >= 0, "length must be >= 0");
  const c10::cuda::CUDAGuard guard(bitmap.device());
  const auto bits = bitmap.reshape(-1).contiguous();
  const int64_t n = std::min(length, bits.numel() * 8);
  at::Tensor out = at::empty({n}, bits.options().dtype(at::kBool));
  if (n) {
    unpack_bits_kernel<<<blocks_for(n, kThreads), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        bits.data_ptr<uint8_t>(), out.data_ptr<bool>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Zen hash partitioning on CUDA (see ddlscale.sync.sparse.native)";
  m.def("server_of", &server_of, "owning server h0(index) of each int64 index");
  m.def("partition", &partition, "hash, then group (index, value) pairs by server, stable");
  m.def("group_by_server", &group_by_server, "group (index, value) pairs by given server ids, stable");
  m.def("pack_bits", &pack_bits, "bool mask -> uint8 bitmap, little-endian bit order");
  m.def("unpack_bits", &unpack_bits, "uint8 bitmap -> first `length` bits as bool");
}
