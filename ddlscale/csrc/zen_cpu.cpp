// CPU kernels for Zen's hash partitioning and row merging (references: ddlscale/sync/sparse/kernels.py).
//
// The PyTorch references run one full pass over memory per elementary op (about ten for fmix64) and
// partition with a general argsort; here h0 is fused into a single pass and partitioning is a
// counting sort (n buckets are known up front), stable so the output equals the stable argsort.
// Values are only moved, never read as numbers, so they travel as raw rows of bytes: every dtype
// (bf16, fp16, NaN payloads included) comes out bit-identical.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <array>
#include <cstring>
#include <vector>

#include "zen_hash.h"

namespace {

// Elements per task. Waking a second thread costs tens of microseconds on an idle machine and a
// whole scheduler slice on a busy one; below ~64K elements the work itself is shorter than that.
constexpr int64_t kGrain = 1 << 16;

at::Tensor check_indices(const at::Tensor& indices) {
  TORCH_CHECK(indices.device().is_cpu(), "indices must be on the CPU");
  TORCH_CHECK(indices.scalar_type() == at::kLong, "indices must be int64, got ", indices.scalar_type());
  return indices.reshape(-1).contiguous();
}

uint64_t seed_bits(int64_t seed) { return static_cast<uint64_t>(seed); }

zen::Mod63 divider(int64_t num_servers) {
  TORCH_CHECK(num_servers >= 1, "num_servers must be >= 1, got ", num_servers);
  return zen::Mod63(static_cast<uint64_t>(num_servers));
}

// Chunks of a stable counting sort: each is scanned twice by one thread (count, then place), and
// chunk c's items for server s land after those of chunks < c, so the order within a server is the
// input order.
struct Chunks {
  int64_t size, count;
  explicit Chunks(int64_t n) {
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    count = std::max<int64_t>(1, std::min(threads, (n + kGrain - 1) / kGrain));
    size = (n + count - 1) / count;
  }
  int64_t begin(int64_t c, int64_t n) const { return std::min(n, c * size); }
  int64_t end(int64_t c, int64_t n) const { return std::min(n, (c + 1) * size); }
};

// Stable counting sort of n items by owner_of(i) in [0, servers): calls place(i, slot, rank) with
// each item's output slot and its rank among its server's items; returns the count per server.
// owner_of runs twice per item: recomputing h0 is cheaper than storing it and reading it back.
template <typename OwnerOf, typename Place>
at::Tensor counting_sort(int64_t n, int64_t servers, OwnerOf owner_of, Place place) {
  const Chunks chunks(n);
  std::vector<int64_t> hist(chunks.count * servers, 0);
  at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* h = hist.data() + c * servers;
      for (int64_t i = chunks.begin(c, n); i < chunks.end(c, n); ++i) ++h[owner_of(i)];
    }
  });
  at::Tensor counts = at::zeros({servers}, at::kLong);
  int64_t* total = counts.data_ptr<int64_t>();
  std::vector<int64_t> first(servers, 0);
  int64_t next = 0;  // exclusive prefix in (server, chunk) order: where chunk c starts writing server s
  for (int64_t s = 0; s < servers; ++s) {
    first[s] = next;
    for (int64_t c = 0; c < chunks.count; ++c) {
      const int64_t here = hist[c * servers + s];
      hist[c * servers + s] = next;
      next += here;
      total[s] += here;
    }
  }
  at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* cursor = hist.data() + c * servers;
      for (int64_t i = chunks.begin(c, n); i < chunks.end(c, n); ++i) {
        const int64_t s = owner_of(i), slot = cursor[s]++;
        place(i, slot, slot - first[s]);
      }
    }
  });
  return counts;
}

// Rows of `width` bytes moved as one machine word when the width allows, else by memcpy.
template <typename Word>
struct WordRows {
  const Word* in;
  Word* out;
  void move(int64_t from, int64_t to) const { out[to] = in[from]; }
};
struct ByteRows {
  const uint8_t* in;
  uint8_t* out;
  int64_t width;
  void move(int64_t from, int64_t to) const { std::memcpy(out + to * width, in + from * width, width); }
};

template <typename F>
void with_rows(const at::Tensor& src, at::Tensor& dst, int64_t rows, F f) {
  const int64_t width = rows ? src.numel() / rows * src.element_size() : 0;
  auto in = static_cast<const uint8_t*>(src.data_ptr());
  auto out = static_cast<uint8_t*>(dst.data_ptr());
  // Word moves need word-aligned rows (a view with a storage offset may not be); else bytes.
  const auto aligned = [&](int64_t w) {
    return width == w && reinterpret_cast<uintptr_t>(in) % w == 0 && reinterpret_cast<uintptr_t>(out) % w == 0;
  };
  if (aligned(1)) return f(WordRows<uint8_t>{in, out});
  if (aligned(2)) return f(WordRows<uint16_t>{reinterpret_cast<const uint16_t*>(in), reinterpret_cast<uint16_t*>(out)});
  if (aligned(4)) return f(WordRows<uint32_t>{reinterpret_cast<const uint32_t*>(in), reinterpret_cast<uint32_t*>(out)});
  if (aligned(8)) return f(WordRows<uint64_t>{reinterpret_cast<const uint64_t*>(in), reinterpret_cast<uint64_t*>(out)});
  return f(ByteRows{in, out, width});
}

void check_values(const at::Tensor& values, int64_t n) {
  TORCH_CHECK(values.device().is_cpu(), "values must be on the CPU");
  TORCH_CHECK(values.dim() >= 1 && values.size(0) == n, "values must have one row per index: ", n,
              " indices, values of shape ", values.sizes());
}

// (indices, values) reordered by owner_of, stable, with the count per server.
template <typename OwnerOf>
std::tuple<at::Tensor, at::Tensor, at::Tensor> group(const at::Tensor& idx, const at::Tensor& values,
                                                     int64_t servers, OwnerOf owner_of) {
  const int64_t n = idx.numel();
  check_values(values, n);
  const at::Tensor vals = values.contiguous();
  at::Tensor idx_out = at::empty_like(idx), val_out = at::empty_like(vals);
  const int64_t* ii = idx.data_ptr<int64_t>();
  int64_t* io = idx_out.data_ptr<int64_t>();
  at::Tensor counts;
  with_rows(vals, val_out, n, [&](auto rows) {
    counts = counting_sort(n, servers, owner_of, [&](int64_t i, int64_t slot, int64_t) {
      io[slot] = ii[i];
      rows.move(i, slot);
    });
  });
  return {idx_out, val_out, counts};
}

}  // namespace

at::Tensor server_of(const at::Tensor& indices, int64_t seed, int64_t num_servers) {
  auto idx = check_indices(indices);
  const auto mod = divider(num_servers);
  const uint64_t s = seed_bits(seed);
  at::Tensor out = at::empty_like(idx);
  const int64_t* in = idx.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, idx.numel(), kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) o[i] = zen::owner(in[i], s, mod);
  });
  return out.view(indices.sizes());
}

// (indices, values) grouped by owning server h0(index), stable; plus the count per server.
std::tuple<at::Tensor, at::Tensor, at::Tensor> partition(const at::Tensor& indices, const at::Tensor& values,
                                                         int64_t seed, int64_t num_servers) {
  const auto idx = check_indices(indices);
  const auto mod = divider(num_servers);
  const uint64_t s = seed_bits(seed);
  const int64_t* in = idx.data_ptr<int64_t>();
  return group(idx, values, num_servers, [&](int64_t i) { return zen::owner(in[i], s, mod); });
}

// The same grouping when the owners are already known (split_by_server's contract).
std::tuple<at::Tensor, at::Tensor, at::Tensor> group_by_server(const at::Tensor& server, const at::Tensor& indices,
                                                               const at::Tensor& values, int64_t num_servers) {
  const auto own = check_indices(server);
  const auto idx = check_indices(indices);
  TORCH_CHECK(num_servers >= 1, "num_servers must be >= 1, got ", num_servers);
  TORCH_CHECK(idx.numel() == own.numel(), "one server id per index: ", own.numel(), " ids, ", idx.numel(), " indices");
  if (own.numel()) {
    auto [lo, hi] = at::aminmax(own);
    TORCH_CHECK(lo.item<int64_t>() >= 0 && hi.item<int64_t>() < num_servers, "server ids must lie in [0, ",
                num_servers, ")");
  }
  const int64_t* o = own.data_ptr<int64_t>();
  return group(idx, values, num_servers, [&](int64_t i) { return o[i]; });
}

// Every server's owned indices among 0..numel-1, sorted, concatenated, and the count per server:
// one counting sort of the index range. int32 output when it fits (the bitmap pull keeps this
// array: 4 bytes per row, nothing else), int64 otherwise.
std::tuple<at::Tensor, at::Tensor> owned_sets(int64_t numel, int64_t seed, int64_t num_servers) {
  TORCH_CHECK(numel >= 0, "numel must be >= 0");
  const auto mod = divider(num_servers);
  const uint64_t s = seed_bits(seed);
  const bool narrow = numel <= (int64_t(1) << 31);
  at::Tensor owned = at::empty({numel}, narrow ? at::kInt : at::kLong);
  at::Tensor counts;
  const auto owner_of = [&](int64_t i) { return zen::owner(i, s, mod); };
  if (narrow) {
    int32_t* ow = owned.data_ptr<int32_t>();
    counts = counting_sort(numel, num_servers, owner_of, [&](int64_t i, int64_t slot, int64_t) { ow[slot] = int32_t(i); });
  } else {
    int64_t* ow = owned.data_ptr<int64_t>();
    counts = counting_sort(numel, num_servers, owner_of, [&](int64_t i, int64_t slot, int64_t) { ow[slot] = i; });
  }
  return {owned, counts};
}

// The sum of two sparse row sets whose indices are sorted and distinct: one linear merge (SparCML's
// and HC's step). A row in both is lower + upper, computed in that order, so the two partners of a
// doubling stage, merging the same pair, get the same bits; a row in one is copied as it is.
std::tuple<at::Tensor, at::Tensor> merge_rows(const at::Tensor& lower_idx, const at::Tensor& lower_val,
                                              const at::Tensor& upper_idx, const at::Tensor& upper_val) {
  const auto ai = check_indices(lower_idx), bi = check_indices(upper_idx);
  TORCH_CHECK(lower_val.device().is_cpu() && upper_val.device().is_cpu(), "values must be on the CPU");
  TORCH_CHECK(lower_val.dim() == 2 && upper_val.dim() == 2 && lower_val.size(1) == upper_val.size(1),
              "values must be (rows, width) with one width, got ", lower_val.sizes(), " and ", upper_val.sizes());
  TORCH_CHECK(lower_val.scalar_type() == upper_val.scalar_type(), "values must share a dtype");
  TORCH_CHECK(lower_val.size(0) == ai.numel() && upper_val.size(0) == bi.numel(), "one value row per index");
  const at::Tensor av = lower_val.contiguous(), bv = upper_val.contiguous();
  const int64_t na = ai.numel(), nb = bi.numel(), width = av.size(1);
  at::Tensor idx = at::empty({na + nb}, at::kLong), val = at::empty({na + nb, width}, av.options());
  const int64_t* a = ai.data_ptr<int64_t>();
  const int64_t* b = bi.data_ptr<int64_t>();
  int64_t* o = idx.data_ptr<int64_t>();
  int64_t k = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, av.scalar_type(), "merge_rows", [&] {
    const scalar_t* x = av.data_ptr<scalar_t>();
    const scalar_t* y = bv.data_ptr<scalar_t>();
    scalar_t* z = val.data_ptr<scalar_t>();
    const auto copy = [&](const scalar_t* row) { std::memcpy(z + k * width, row, width * sizeof(scalar_t)); };
    int64_t i = 0, j = 0;
    while (i < na && j < nb) {
      if (a[i] < b[j]) {
        o[k] = a[i];
        copy(x + i++ * width);
      } else if (b[j] < a[i]) {
        o[k] = b[j];
        copy(y + j++ * width);
      } else {
        o[k] = a[i];
        const scalar_t* p = x + i++ * width;
        const scalar_t* q = y + j++ * width;
        scalar_t* r = z + k * width;
        for (int64_t c = 0; c < width; ++c) r[c] = p[c] + q[c];
      }
      ++k;
    }
    for (; i < na; ++i, ++k) { o[k] = a[i]; copy(x + i * width); }
    for (; j < nb; ++j, ++k) { o[k] = b[j]; copy(y + j * width); }
  });
  return {idx.narrow(0, 0, k), val.narrow(0, 0, k)};
}

namespace {
// Byte b spread to 8 bytes of 0/1, bit j to byte j (little-endian bit order).
constexpr std::array<uint64_t, 256> make_spread() {
  std::array<uint64_t, 256> table{};
  for (int b = 0; b < 256; ++b)
    for (int j = 0; j < 8; ++j)
      if (b >> j & 1) table[b] |= uint64_t(1) << (8 * j);
  return table;
}
constexpr auto kSpread = make_spread();

// 8 bool bytes (each 0 or 1) to one byte, byte j to bit j: the multiply moves byte j's bit to bit
// 56+j and no two partial products share a bit, so nothing carries into the top byte.
inline uint8_t gather8(uint64_t eight) { return static_cast<uint8_t>((eight * 0x0102040810204080ULL) >> 56); }

bool little_endian() {
  const uint16_t probe = 1;
  return *reinterpret_cast<const uint8_t*>(&probe) == 1;
}
}  // namespace

at::Tensor pack_bits(const at::Tensor& mask) {
  TORCH_CHECK(mask.device().is_cpu() && mask.scalar_type() == at::kBool, "mask must be a CPU bool tensor");
  auto m = mask.reshape(-1).contiguous();
  const int64_t n = m.numel(), full = n / 8;
  at::Tensor out = at::empty({(n + 7) / 8}, at::kByte);
  auto in = reinterpret_cast<const uint8_t*>(m.data_ptr<bool>());
  uint8_t* o = out.data_ptr<uint8_t>();
  const bool fast = little_endian();
  at::parallel_for(0, full, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      if (fast) {
        uint64_t eight;
        std::memcpy(&eight, in + 8 * b, 8);
        o[b] = gather8(eight);
      } else {
        uint8_t byte = 0;
        for (int j = 0; j < 8; ++j) byte |= in[8 * b + j] << j;
        o[b] = byte;
      }
    }
  });
  if (full * 8 < n) {
    uint8_t byte = 0;
    for (int64_t i = full * 8; i < n; ++i) byte |= in[i] << (i - full * 8);
    o[full] = byte;
  }
  return out;
}

// First `length` bits of a bitmap as bools (fewer when the bitmap is shorter, like the reference).
at::Tensor unpack_bits(const at::Tensor& bitmap, int64_t length) {
  TORCH_CHECK(bitmap.device().is_cpu() && bitmap.scalar_type() == at::kByte, "bitmap must be a CPU uint8 tensor");
  TORCH_CHECK(length >= 0, "length must be >= 0");
  auto bits = bitmap.reshape(-1).contiguous();
  const int64_t n = std::min(length, bits.numel() * 8), full = n / 8;
  at::Tensor out = at::empty({n}, at::kBool);
  const uint8_t* in = bits.data_ptr<uint8_t>();
  auto o = reinterpret_cast<uint8_t*>(out.data_ptr<bool>());
  const bool fast = little_endian();
  at::parallel_for(0, full, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      if (fast) {
        std::memcpy(o + 8 * b, &kSpread[in[b]], 8);
      } else {
        for (int j = 0; j < 8; ++j) o[8 * b + j] = in[b] >> j & 1;
      }
    }
  });
  for (int64_t i = full * 8; i < n; ++i) o[i] = in[full] >> (i - full * 8) & 1;
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Zen hash partitioning on the CPU (see ddlscale.sync.sparse.native)";
  m.def("server_of", &server_of, "owning server h0(index) of each int64 index");
  m.def("partition", &partition, "hash, then group (index, value) pairs by server, stable");
  m.def("group_by_server", &group_by_server, "group (index, value) pairs by given server ids, stable");
  m.def("owned_sets", &owned_sets, "every server's owned indices (sorted, concatenated) and counts");
  m.def("merge_rows", &merge_rows, "sum of two row sets with sorted distinct indices, by one linear merge");
  m.def("pack_bits", &pack_bits, "bool mask -> uint8 bitmap, little-endian bit order");
  m.def("unpack_bits", &unpack_bits, "uint8 bitmap -> first `length` bits as bool");
}
