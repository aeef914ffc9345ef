"""Zen's CUDA kernels (``ddlscale/csrc/zen_cuda.cu``) run through cupy: the CUDA source is compiled at run
time by NVRTC, so a GPU machine needs ``pip install -e '.[gpu]'`` and neither nvcc nor a toolkit matching
torch's.

Tensors stay torch's: outputs come from torch's caching allocator, every operand reaches cupy zero-copy
through DLPack, and the kernels launch on torch's current stream of the tensors' device, so they order
with the surrounding torch work like any torch op. :class:`CudaOps` takes and returns what the CPU
extension does (:mod:`.kernels` calls both the same way); :mod:`.native` decides when it is used.

cupy caches each compiled module on disk (``~/.cupy/kernel_cache``, or ``$CUPY_CACHE_DIR``) under a hash
of its source text and options, and :func:`kernel_source` inlines ``zen_hash.h``, so an edit to either
file compiles afresh while every later process, spawned workers too, loads the cached binary.
"""

from __future__ import annotations

import contextlib
from types import ModuleType

import torch

from ddlscale.paths import CSRC_DIR

SOURCE, HEADER = "zen_cuda.cu", "zen_hash.h"
# The source's extern "C" entry points, each looked up by this name (tests/sync/sparse/test_cuda_ops.py checks
# them against the source and, where NVRTC is at hand, against the compiled PTX).
KERNELS = ("zen_server_of", "zen_count", "zen_scatter_1", "zen_scatter_2", "zen_scatter_4", "zen_scatter_8",
           "zen_scatter_bytes", "zen_pack_bits", "zen_unpack_bits")
OPTIONS = ("-std=c++17",)  # cupy adds the device's architecture
WARP, THREADS = 32, 256
MAX_SERVERS = 4096  # per-warp counters live in shared memory
SHARED_CURSORS = 6144  # int64 cursors per block: 48 KiB, the default shared-memory limit
_WORD_ROWS = {1: "zen_scatter_1", 2: "zen_scatter_2", 4: "zen_scatter_4", 8: "zen_scatter_8"}


def kernel_source() -> str:
    """zen_cuda.cu with zen_hash.h inlined: one text that NVRTC compiles without include paths."""
    source, header = (CSRC_DIR / SOURCE).read_text(), (CSRC_DIR / HEADER).read_text()
    include = f'#include "{HEADER}"'
    if source.count(include) != 1:
        raise ValueError(f"{SOURCE} must include {HEADER} exactly once")
    return source.replace(include, header)


def divider(num_servers: int) -> tuple[int, int, int]:
    """(d, magic, shift) of zen_hash.h's Mod63: x % d == x - (mulhi(x, magic) >> shift) * d for every
    x < 2^63, or x & (d - 1) when magic == 0 (d a power of two). Computed here because NVRTC's device
    code has no 128-bit host arithmetic to compute it with."""
    d = int(num_servers)
    if d < 1:
        raise ValueError(f"num_servers must be >= 1, got {d}")
    if d & (d - 1) == 0:
        return d, 0, 0
    bits = d.bit_length()  # ceil(log2 d) for a d that is not a power of two
    return d, -(-(1 << (63 + bits)) // d), bits - 1


def _blocks(work: int, per_block: int) -> int:
    return max(1, min(-(-work // per_block), 1 << 30))  # grid-stride kernels cover the rest


class CudaOps:
    """The CUDA kernels, compiled for the current device when built (a failure shows here, once).

    Everything between the kernels (argument order, launch geometry, the scan, row widths) is host code
    here; tests/sync/sparse/test_cuda_ops.py runs it on the CPU against an emulation of the kernels, through
    ``device_type``, ``_on`` and ``_launch``.
    """

    device_type = "cuda"

    def __init__(self, cupy: ModuleType):
        import numpy

        self._cp, self._np = cupy, numpy
        module = cupy.RawModule(code=kernel_source(), options=OPTIONS)
        self._kernels = {name: module.get_function(name) for name in KERNELS}
        with cupy.cuda.Device(torch.cuda.current_device()):
            for kernel in self._kernels.values():
                kernel.compile()  # other devices compile (or load from the cache) on first use

    def _check(self, tensor: torch.Tensor, dtype: torch.dtype, what: str) -> None:
        if tensor.device.type != self.device_type or tensor.dtype != dtype:
            raise ValueError(f"{what} must be a {dtype} {self.device_type} tensor, got {tensor.dtype} on "
                             f"{tensor.device}")

    def _ids(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        self._check(tensor, torch.int64, what)
        return tensor.reshape(-1).contiguous()

    @contextlib.contextmanager
    def _on(self, device: torch.device):
        """cupy set to the tensors' device and torch's current stream there."""
        cp = self._cp
        stream = torch.cuda.current_stream(device)
        with cp.cuda.Device(device.index):
            if hasattr(cp.cuda.Stream, "from_external"):  # cupy >= 14: the CUDA stream protocol
                external = cp.cuda.Stream.from_external(stream)
            else:
                external = cp.cuda.ExternalStream(stream.cuda_stream, device.index)
            with external:
                yield

    def _launch(self, name: str, blocks: int, threads: int, args: tuple, shared: int = 0) -> None:
        # Tensors are handed over inside _on, so DLPack's sync to the consuming stream is a no-op, and
        # detached: DLPack refuses tensors that require grad (the kernels have no backward anyway).
        cp = self._cp
        converted = tuple(cp.from_dlpack(a.detach()) if isinstance(a, torch.Tensor) else a for a in args)
        self._kernels[name]((blocks,), (threads,), converted, shared_mem=shared)

    def _owner(self, key: torch.Tensor, hashed: bool, seed: int, num_servers: int) -> tuple:
        np = self._np
        d, magic, shift = divider(num_servers)
        return (key, np.int32(hashed), np.uint64(seed & (2**64 - 1)), np.uint64(d), np.uint64(magic),
                np.int32(shift))

    def server_of(self, indices: torch.Tensor, seed: int, num_servers: int) -> torch.Tensor:
        idx = self._ids(indices, "indices")
        _, hashed, seed64, d, magic, shift = self._owner(idx, True, seed, num_servers)
        out = torch.empty_like(idx)
        if idx.numel():
            with self._on(idx.device):
                self._launch("zen_server_of", _blocks(idx.numel(), THREADS), THREADS,
                             (idx, seed64, d, magic, shift, out, self._np.int64(idx.numel())))
        return out.view(indices.shape)

    def partition(self, indices: torch.Tensor, values: torch.Tensor, seed: int, num_servers: int):
        idx = self._ids(indices, "indices")
        return self._group(idx, True, idx, values, seed, num_servers)

    def group_by_server(self, server: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
                        num_servers: int):
        own, idx = self._ids(server, "server"), self._ids(indices, "indices")
        if own.numel() != idx.numel():
            raise ValueError(f"one server id per index: {own.numel()} ids for {idx.numel()} indices")
        if own.numel():
            lo, hi = torch.aminmax(own)
            if int(lo) < 0 or int(hi) >= num_servers:
                raise ValueError(f"server ids must lie in [0, {num_servers}), got [{int(lo)}, {int(hi)}]")
        return self._group(own, False, idx, values, 0, num_servers)

    def _group(self, key: torch.Tensor, hashed: bool, idx: torch.Tensor, values: torch.Tensor, seed: int,
               servers: int):
        """(indices, values) grouped by server, stable, and the count per server (int64 on the device)."""
        np, n = self._np, idx.numel()
        if values.device != idx.device or values.dim() < 1 or values.shape[0] != n:
            raise ValueError(f"values must be on {idx.device} with one row per index ({n}), got "
                             f"{tuple(values.shape)} on {values.device}")
        owner = self._owner(key, hashed, seed, servers)
        vals = values.contiguous()
        if servers > MAX_SERVERS:  # too many counters for shared memory: a stable sort on the device
            server = self.server_of(key, seed, servers) if hashed else key
            order = torch.argsort(server, stable=True)
            return idx[order], vals[order], torch.bincount(server, minlength=servers)
        idx_out = torch.empty_like(idx)
        val_out = torch.empty(vals.shape, dtype=vals.dtype, device=vals.device)
        if n == 0:
            return idx_out, val_out, torch.zeros(servers, dtype=torch.int64, device=idx.device)
        # Tiles of >= 32 rounds, longer with many servers, so the per-tile counts stay ~n/32 in all.
        tile = WARP * max(32, servers)
        tiles = -(-n // tile)
        warps = max(1, min(THREADS // WARP, SHARED_CURSORS // servers))
        blocks = -(-tiles // warps)
        hist = torch.empty((servers, tiles), dtype=torch.int64, device=idx.device)
        sizes = (np.int64(n), np.int64(tile), np.int64(tiles), np.int32(servers))
        row_bytes = vals.numel() // n * vals.element_size()
        # Rows move as raw bytes, one word at a time where a row is one aligned word.
        name = _WORD_ROWS.get(row_bytes) if vals.data_ptr() % max(row_bytes, 1) == 0 else None
        src, dst = (vals.reshape(-1).view(torch.uint8), val_out.reshape(-1).view(torch.uint8)) if row_bytes \
            else (idx, idx_out)  # no bytes to move: any valid pointers
        with self._on(idx.device):
            self._launch("zen_count", blocks, warps * WARP, (*owner, *sizes, hist),
                         shared=warps * servers * 4)
            flat = hist.view(-1)
            offsets = flat.cumsum(0) - flat  # exclusive, in (server, tile) order
            self._launch(name or "zen_scatter_bytes", blocks, warps * WARP,
                         (*owner, idx, src, dst, np.int64(row_bytes), *sizes, offsets, idx_out),
                         shared=warps * servers * 8)
        return idx_out, val_out, hist.sum(1)

    def pack_bits(self, mask: torch.Tensor) -> torch.Tensor:
        self._check(mask, torch.bool, "mask")
        m = mask.reshape(-1).contiguous()
        n, nbytes = m.numel(), (m.numel() + 7) // 8
        out = torch.empty(nbytes, dtype=torch.uint8, device=m.device)
        if n:  # whole blocks: every lane of every warp takes part in the ballot
            with self._on(m.device):
                self._launch("zen_pack_bits", -(-n // THREADS), THREADS,
                             (m.view(torch.uint8), out, self._np.int64(n), self._np.int64(nbytes)))
        return out

    def unpack_bits(self, bitmap: torch.Tensor, length: int) -> torch.Tensor:
        self._check(bitmap, torch.uint8, "bitmap")
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        bits = bitmap.reshape(-1).contiguous()
        n = min(length, bits.numel() * 8)
        out = torch.empty(n, dtype=torch.bool, device=bits.device)
        if n:
            with self._on(bits.device):
                self._launch("zen_unpack_bits", _blocks(n, THREADS), THREADS,
                             (bits, out.view(torch.uint8), self._np.int64(n)))
        return out
