"""Zen's CUDA kernels and their cupy loader (ddlscale.sync.sparse.cuda_ops), checked without a GPU.

- the source is plain CUDA that NVRTC can compile: no torch or standard-library header, and its
  extern "C" entry points are exactly the names the loader asks for; where libnvrtc is at hand
  (cupy's pip wheels, a CUDA toolkit) it is compiled, and the PTX holds those entry points;
- the divider's magic numbers computed in Python give x % d exactly;
- the loader's host code (argument order and types, launch geometry, the scan between the passes,
  row widths and alignment) runs on CPU tensors against a Python emulation of each kernel, bit for bit
  against the pure-PyTorch references;
- without cupy (simulated by hiding the module) the dispatch keeps the references, silently; a cupy
  that cannot compile the kernels warns once.
The kernels themselves run on a GPU in experiments/gpu_check.py, section C.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import os
import re
import sys
import types
import warnings

import numpy as np
import pytest
import torch

from ddlscale.paths import CSRC_DIR as CSRC
from ddlscale.sync.sparse import cuda_ops, native
from ddlscale.sync.sparse.cuda_ops import KERNELS, CudaOps, divider, kernel_source
from ddlscale.sync.sparse.kernels import (
    pack_bits_reference,
    partition_reference,
    server_of_reference,
    split_by_server_reference,
    unpack_bits_reference,
)

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def signatures() -> dict[str, list[str]]:
    """Each extern "C" kernel's parameters as 'pointer', 'int64', 'uint64' or 'int32', from the source."""
    text = (CSRC / cuda_ops.SOURCE).read_text()
    for name, body in re.findall(r"#define (\w+)((?:[^\n]*\\\n)*[^\n]*)", text):
        if "(" not in name:  # object-like macros only: the shared parameter list
            text = text.replace(f"({name})", "(" + body.replace("\\\n", " ") + ")")
    kinds = {}
    for name, params in re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', text):
        kinds[name] = []
        for param in params.split(","):
            tokens = param.replace("*", " * ").split()
            kind = ("pointer" if "*" in tokens else "uint64" if "u64" in tokens else
                    "int64" if "i64" in tokens else "int32" if tokens[:1] == ["int"] else f"unknown {param}")
            kinds[name].append(kind)
    return kinds


def test_the_kernel_source_is_plain_cuda_with_the_names_the_loader_asks_for():
    source = kernel_source()
    assert re.findall(r"#include.*", source) == [], "NVRTC gets one text: zen_hash.h inlined, nothing else"
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", source, flags=re.S)  # the comments may name torch
    for word in ("torch", "ATen", "at::", "c10", "pybind11", "TORCH_", "std::", "<<<"):
        assert word not in code, word
    assert re.findall(r"#include.*", (CSRC / cuda_ops.SOURCE).read_text()) == [f'#include "{cuda_ops.HEADER}"']
    kinds = signatures()
    assert sorted(kinds) == sorted(KERNELS)
    assert all(not k.startswith("unknown") for params in kinds.values() for k in params), kinds
    assert len({tuple(kinds[n]) for n in KERNELS if n.startswith("zen_scatter")}) == 1  # one launch for all widths


def _libnvrtc() -> str | None:
    """libnvrtc from cupy's pathfinder, NVIDIA's pip wheel, a CUDA toolkit, or the loader's path."""
    with contextlib.suppress(Exception):
        from cuda.pathfinder import load_nvidia_dynamic_lib

        return load_nvidia_dynamic_lib("nvrtc").abs_path
    with contextlib.suppress(ImportError):
        import nvidia.cuda_nvrtc

        found = [p for d in nvidia.cuda_nvrtc.__path__ for p in glob.glob(f"{d}/lib/libnvrtc.so*")]
        if found:
            return sorted(found)[0]
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), *glob.glob("/usr/local/cuda*")]
    found = [p for r in roots if r for p in glob.glob(f"{r}/lib*/libnvrtc.so*") if "builtins" not in p]
    return sorted(found)[0] if found else ctypes.util.find_library("nvrtc")


def nvrtc_ptx(lib: ctypes.CDLL, source: str, options: list[str]) -> tuple[int, str, str]:
    """(status, log, ptx) of NVRTC compiling ``source``: what cupy does on the GPU machine."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"zen_cuda.cu", 0, None, None) == 0
    try:
        opts = [o.encode() for o in options]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        ptx = ""
        if status == 0:
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            buffer = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, buffer)
            ptx = buffer.value.decode()
        return status, log.value.decode(), ptx
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def test_nvrtc_compiles_the_kernels_with_the_loaders_options():
    path = _libnvrtc()
    if path is None:
        pytest.skip("no libnvrtc here (pip install nvidia-cuda-nvrtc-cu12 or a CUDA toolkit brings one)")
    lib = ctypes.CDLL(path)
    for arch in ("compute_75", "compute_90"):  # Turing (NVRTC 13 has dropped Volta); Hopper
        status, log, ptx = nvrtc_ptx(lib, kernel_source(), [*cuda_ops.OPTIONS, f"--gpu-architecture={arch}"])
        assert status == 0, log
        assert sorted(re.findall(r"\.entry (\w+)\(", ptx)) == sorted(KERNELS), arch
        assert "error" not in log.lower(), log


def test_the_divider_gives_the_exact_remainder():
    """What the kernels compute with the magic numbers the loader hands them, in Python integers."""
    top = (1 << 63) - 1
    g = torch.Generator().manual_seed(0)
    randoms = [int(x) for x in torch.randint(0, 2**62, (2000,), generator=g)]
    for n in (*range(1, 13), 1000, 4096, 1_000_003, 2**32 + 1, 2**62, 2**62 + 1, 2**63 - 1):
        d, magic, shift = divider(n)
        assert d == n and 0 <= magic < 2**64 and (magic == 0) == (n & (n - 1) == 0)
        for x in {0, 1, n - 1, n, n + 1, top, top - 1, top - top % n, top - top % n - 1, *randoms}:
            got = x & (d - 1) if magic == 0 else x - (((x * magic) >> 64) >> shift) * d
            assert got == x % n, (n, x)
    with pytest.raises(ValueError, match="num_servers"):
        divider(0)


# -- the loader's host code against an emulation of the kernels ---------------------------------------
_M64 = np.uint64(2**64 - 1)


def _mulhi(a: np.ndarray, b: int) -> np.ndarray:
    lo32 = np.uint64(0xFFFFFFFF)
    a_lo, a_hi = a & lo32, a >> np.uint64(32)
    b_lo, b_hi = np.uint64(b & 0xFFFFFFFF), np.uint64(b >> 32)
    cross = ((a_lo * b_lo) >> np.uint64(32)) + ((a_hi * b_lo) & lo32) + a_lo * b_hi
    return a_hi * b_hi + ((a_hi * b_lo) >> np.uint64(32)) + (cross >> np.uint64(32))


def _owners(key: torch.Tensor, hashed, seed, d, magic, shift, n: int) -> np.ndarray:
    """zen_hash.h's owner(): fmix64(index ^ seed), top bit cleared, Mod63; or the given ids."""
    k = key.numpy()[:n].copy()
    if not hashed:
        return k
    with np.errstate(over="ignore"):
        x = k.view(np.uint64) ^ seed
        for c in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
            x = (x ^ (x >> np.uint64(33))) * np.uint64(c)
        x = (x ^ (x >> np.uint64(33))) & np.uint64(2**63 - 1)
        q = x & (d - np.uint64(1)) if magic == 0 else x - (_mulhi(x, int(magic)) >> np.uint64(shift)) * d
    return q.astype(np.int64)


class EmulatedOps(CudaOps):
    """CudaOps on CPU tensors, each launch checked against the kernel's signature and geometry, then
    carried out by a Python emulation of the kernel."""

    device_type = "cpu"
    SIGNATURES = signatures()
    KINDS = {np.int64: "int64", np.uint64: "uint64", np.int32: "int32"}

    def __init__(self):
        self._np, self.launched = np, set()

    def _on(self, device):
        return contextlib.nullcontext()

    def _launch(self, name, blocks, threads, args, shared=0):
        kinds = ["pointer" if isinstance(a, torch.Tensor) else self.KINDS[type(a)] for a in args]
        assert kinds == self.SIGNATURES[name], (name, kinds)
        assert 1 <= blocks < 2**31 and threads % 32 == 0 and 32 <= threads <= 1024 and shared <= 48 * 1024
        self.launched.add(name)
        getattr(self, "_" + ("zen_scatter" if name.startswith("zen_scatter") else name))(
            name, blocks, threads, shared, *args)

    def _zen_server_of(self, name, blocks, threads, shared, idx, seed, d, magic, shift, out, n):
        out[:n] = torch.from_numpy(_owners(idx, True, seed, d, magic, shift, int(n)))

    def _zen_count(self, name, blocks, threads, shared, key, hashed, seed, d, magic, shift, n, tile, tiles,
                   servers, hist):
        warps = threads // 32
        assert blocks * warps >= tiles and shared >= warps * servers * 4  # every tile has a warp and counters
        owner = _owners(key, hashed, seed, d, magic, shift, int(n))
        flat, tile, tiles, servers = hist.view(-1), int(tile), int(tiles), int(servers)
        for t in range(tiles):
            counts = np.bincount(owner[t * tile: (t + 1) * tile], minlength=servers)
            flat[torch.arange(servers) * tiles + t] = torch.from_numpy(counts)

    def _zen_scatter(self, name, blocks, threads, shared, key, hashed, seed, d, magic, shift, idx, src, dst,
                     width, n, tile, tiles, servers, offsets, idx_out):
        warps = threads // 32
        assert blocks * warps >= tiles and shared >= warps * servers * 8
        word = name.rsplit("_", 1)[1]
        if word != "bytes":  # a word kernel reads whole aligned words of exactly the row's width
            assert int(word) == width and src.data_ptr() % width == 0 and dst.data_ptr() % width == 0
        n, width = int(n), int(width)
        # Item i of tile t for server s lands at offsets[s, t] plus the number of earlier items of the
        # same tile and server (the warp's lane-ordered ranks and cursor).
        group = _owners(key, hashed, seed, d, magic, shift, n) * int(tiles) + np.arange(n) // int(tile)
        order = np.argsort(group, kind="stable")
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n) - np.searchsorted(group[order], group[order], side="left")
        slot = offsets[torch.from_numpy(group)] + torch.from_numpy(rank)
        idx_out[slot] = idx[:n]
        if width:
            dst.view(-1, width)[slot] = src.view(-1, width)[:n]

    def _zen_pack_bits(self, name, blocks, threads, shared, mask, out, n, nbytes):
        assert blocks * threads >= n  # one thread per element, no grid-stride loop
        bits = torch.zeros(nbytes * 8, dtype=torch.uint8)
        bits[:n] = mask[:n] != 0
        out[:] = (bits.view(-1, 8).to(torch.int64) << torch.arange(8)).sum(1).to(torch.uint8)

    def _zen_unpack_bits(self, name, blocks, threads, shared, bitmap, out, n):
        i = torch.arange(int(n))
        out[:] = (bitmap[i >> 3] >> (i & 7)) & 1


def _grouped_equal(got, ref) -> bool:
    return got[2].tolist() == ref[2] and torch.equal(got[0], ref[0]) and same_bits(got[1], ref[1])


def test_host_code_hashes_and_groups_like_the_references():
    emulated = EmulatedOps()
    g = torch.Generator().manual_seed(1)
    for size in (0, 1, 37, 2500):
        idx = torch.randint(-(2**63), 2**63 - 1, (size,), generator=g, dtype=torch.int64)
        for k, dtype in enumerate(DTYPES):
            val = torch.randn(size, generator=g).to(dtype)
            val[: min(2, size)] = float("nan")
            for n in (1, 2, 3, 5, 8, 1000, 5000):  # 5000: past the shared-memory counters, a device sort
                seed = 0x5EED + k - (2**62 if k % 2 else 0)  # negative seeds too
                assert torch.equal(emulated.server_of(idx, seed, n), server_of_reference(idx, seed, n))
                assert _grouped_equal(emulated.partition(idx, val, seed, n), partition_reference(idx, val, seed, n))
                server = server_of_reference(idx, seed, n)
                assert _grouped_equal(emulated.group_by_server(server, idx, val, n),
                                      split_by_server_reference(server, idx, val, n)), (size, dtype, n)
    grid = torch.randint(0, 100, (4, 5), generator=g)
    assert torch.equal(emulated.server_of(grid, 3, 7), server_of_reference(grid, 3, 7))  # shape kept
    assert {"zen_server_of", "zen_count", "zen_scatter_2", "zen_scatter_4", "zen_scatter_8"} <= emulated.launched


def test_host_code_moves_rows_of_every_width_and_alignment():
    emulated = EmulatedOps()
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 10**6, (700,), generator=g)
    m = idx.numel()
    base = torch.randn(m + 1, 2, generator=g).to(torch.float16)
    cases = [torch.randint(-100, 100, (m,), generator=g, dtype=torch.int8),
             torch.randn(m, 3, generator=g),  # 12-byte rows: bytewise
             torch.randn(m, generator=g, dtype=torch.float64).to(torch.complex128),  # 16 bytes
             base.view(-1)[1: 2 * m + 1].view(m, 2),  # 4-byte rows starting 2 bytes off: bytewise
             base.view(-1)[2: 2 * m + 2].view(m, 2),  # 4 bytes off: one aligned word per row
             torch.randint(-(2**15), 2**15, (m,), generator=g, dtype=torch.int16),
             torch.randn(m, 2, generator=g, dtype=torch.float64)[:, 0],  # a strided column
             torch.rand(m, generator=g) > 0.5, torch.empty(m, 0)]
    for values in cases:
        assert _grouped_equal(emulated.partition(idx, values, 9, 5), partition_reference(idx, values, 9, 5)), \
            (values.dtype, values.shape)
    assert {n for n in KERNELS if n.startswith("zen_scatter")} <= emulated.launched


def test_host_code_packs_and_unpacks_bitmaps():
    emulated = EmulatedOps()
    g = torch.Generator().manual_seed(3)
    for length in (*range(0, 70), 1000, 4099):
        mask = torch.rand(length, generator=g) < 0.4
        bitmap = emulated.pack_bits(mask)
        assert torch.equal(bitmap, pack_bits_reference(mask)), length
        for k in {0, max(length - 3, 0), length, length + 5}:
            assert torch.equal(emulated.unpack_bits(bitmap, k), unpack_bits_reference(bitmap, k)), (length, k)
    assert emulated.launched == {"zen_pack_bits", "zen_unpack_bits"}


def test_host_code_refuses_bad_input():
    emulated = EmulatedOps()
    idx = torch.arange(10)
    with pytest.raises(ValueError, match="indices must be a torch.int64"):
        emulated.server_of(idx.float(), 1, 3)
    with pytest.raises(ValueError, match="server ids must lie in"):
        emulated.group_by_server(torch.full((10,), 3), idx, torch.zeros(10), 3)
    with pytest.raises(ValueError, match="one row per index"):
        emulated.partition(idx, torch.zeros(9), 1, 3)
    with pytest.raises(ValueError, match="mask must be a torch.bool"):
        emulated.pack_bits(idx)


# -- dispatch ----------------------------------------------------------------------------------------
@pytest.fixture
def cuda_claimed(monkeypatch):
    """A process that believes it has a GPU and has not tried to load the CUDA kernels yet."""
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_reasons", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("DDLSCALE_NATIVE", raising=False)


def test_without_cupy_the_dispatch_keeps_the_references_silently(cuda_claimed, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy now raises ModuleNotFoundError
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.cuda_ops() is None
        for op in ("server_of", "partition", "split_by_server", "pack_bits", "unpack_bits"):
            assert native.ops_for(op, device="cuda", numel=1000) is None
    assert [w for w in caught if issubclass(w.category, native.NativeKernelWarning)] == []
    reason = native.unavailable_reason("cuda")
    assert "cupy is not installed" in reason and ".[gpu]" in reason


def test_a_cupy_that_cannot_compile_warns_once(cuda_claimed, monkeypatch):
    fake = types.ModuleType("cupy")

    class RawModule:
        def __init__(self, code, options):
            assert code == kernel_source() and options == cuda_ops.OPTIONS
            raise RuntimeError("nvrtc: error: failed to load builtins\nzen_cuda.cu(9): error: something")

    fake.RawModule = RawModule
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.cuda_ops() is None and native.cuda_ops() is None
        assert native.ops_for("partition", device="cuda", numel=10) is None
    messages = [str(w.message) for w in caught if issubclass(w.category, native.NativeKernelWarning)]
    assert len(messages) == 1 and "could not compile ddlscale/csrc/zen_cuda.cu" in messages[0], messages
    assert "failed to load builtins" in native.unavailable_reason("cuda")


def test_no_gpu_means_no_cupy_import(monkeypatch):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_reasons", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))  # would fail if touched
    assert native.cuda_ops() is None and native.unavailable_reason("cuda") == "no CUDA device"
