"""Loading the native kernels (``ddlscale/csrc/``): build once, cache, and say which op may run natively.

This module only finds the kernels for a device; :mod:`ddlscale.sync.sparse.kernels` holds each op's
pure-PyTorch definition beside its dispatch, and asks :func:`ops_for` whether the kernels should run
it on the given tensors (``NATIVE_FROM``).

CPU: the C++ extension is compiled on first use with ``torch.utils.cpp_extension`` into
``$DDLSCALE_EXT_DIR`` (default ``~/.cache/ddlscale/ext``), under a name that carries a hash of the
sources, flags and torch version: edits rebuild, and every later process (spawned workers too)
imports the cached library without calling the compiler. When it cannot be had (``DDLSCALE_NATIVE=0``,
no compiler, no ninja, a failed build) one :class:`NativeKernelWarning` names the reason and the
references run.

CUDA: ``ddlscale/csrc/zen_cuda.cu`` runs through cupy (:mod:`.cuda_ops`: NVRTC at run time, tensors shared by
DLPack), tried only when ``torch.cuda.is_available()``. Without cupy (the ``gpu`` extra not installed)
the references run silently, the reason kept for :func:`unavailable_reason`; a cupy that cannot
compile the kernels warns once. The CUDA kernels are no longer built with ``cpp_extension``: that
needed nvcc and a CUDA toolkit matching torch's on the GPU machine, which pip-installed environments
rarely have, and a second, C++ launcher for the same kernels; through cupy the same source needs
neither, for a few microseconds of Python per launch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from ddlscale.paths import CSRC_DIR

if TYPE_CHECKING:
    from ddlscale.sync.sparse.cuda_ops import CudaOps

SOURCES = {"cpu": ["zen_cpu.cpp", "zen_hash.h"]}  # CUDA: cuda_ops.SOURCE and HEADER, through cupy
CFLAGS = ["-O3", "-fopenmp"]  # at::parallel_for is OpenMP inlined into this library: without it, serial
LDFLAGS = ["-fopenmp"]

# Smallest input (elements) from which the native kernel measurably beat the reference on this
# project's 2-core machine (experiments/results/native_kernels/results.md): every op won at every
# size measured, 1 to 1e7 elements, by 2.5-20x, so all start at 0. An op missing here never runs
# natively. CUDA: the kernels replace a chain of elementwise launches (fmix64 alone is ten) and a
# general sort by one fused pass and a counting sort, so they run from the first element; no GPU
# has timed them yet (experiments/gpu_check.py section C does, and checks them bit for bit). The CUDA
# ops not listed (owned_sets, merge_rows) have no CUDA kernel.
NATIVE_FROM: dict[tuple[str, str], int] = {
    ("cpu", "server_of"): 0,
    ("cpu", "partition"): 0,
    ("cpu", "split_by_server"): 0,
    ("cpu", "owned_sets"): 0,
    ("cpu", "merge_rows"): 0,
    ("cpu", "pack_bits"): 0,
    ("cpu", "unpack_bits"): 0,
    ("cuda", "server_of"): 0,
    ("cuda", "partition"): 0,
    ("cuda", "split_by_server"): 0,
    ("cuda", "pack_bits"): 0,
    ("cuda", "unpack_bits"): 0,
}


class NativeKernelWarning(RuntimeWarning):
    """The native kernels are unavailable; the pure-PyTorch references run instead (same results)."""


class NativeUnavailable(RuntimeError):
    """Why native kernels could not be loaded; ``missing_tool`` when a compiler, ninja or cupy is absent."""

    def __init__(self, reason: str, missing_tool: bool = False):
        super().__init__(reason)
        self.missing_tool = missing_tool


def ext_dir() -> Path:
    return Path(os.environ.get("DDLSCALE_EXT_DIR") or Path.home() / ".cache" / "ddlscale" / "ext")


def module_name(kind: str) -> str:
    """Extension name: a digest of everything that changes the binary, so edits rebuild."""
    digest = hashlib.sha256()
    for source in SOURCES[kind]:
        digest.update((CSRC_DIR / source).read_bytes())
    digest.update(f"{CFLAGS + LDFLAGS}{torch.__version__}{sys.version_info[:2]}{platform.machine()}".encode())
    return f"ddlscale_zen_{kind}_{digest.hexdigest()[:16]}"


def build(kind: str, verbose: bool = False):
    """``kind``'s kernels: the cached CPU extension (built first if needed) or the CUDA kernels compiled
    through cupy; raises :class:`NativeUnavailable`."""
    if kind == "cuda":
        return _cuda_through_cupy()
    if any(not (CSRC_DIR / s).is_file() for s in SOURCES[kind]):
        raise NativeUnavailable(f"sources not found under {CSRC_DIR}")
    name = module_name(kind)
    directory = ext_dir() / name
    library = directory / f"{name}.so"
    ready = directory / "ready"  # written after a complete build: a library mid-link is not imported
    if ready.is_file():
        try:
            return _import(name, library)
        except (ImportError, OSError):
            ready.unlink(missing_ok=True)  # a damaged or foreign cache entry: build it again
    module = _compile(kind, name, directory, verbose)
    ready.write_text(name)
    return module


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(kind: str, name: str, directory: Path, verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise NativeUnavailable(f"no C++ compiler ({compiler!r} is not on PATH)", missing_tool=True)
    if not cpp_extension.is_ninja_available():
        raise NativeUnavailable("ninja is not installed (pip install ninja)", missing_tool=True)
    directory.mkdir(parents=True, exist_ok=True)
    try:  # torch serializes concurrent builds of one directory with a lock file
        return cpp_extension.load(
            name, [str(CSRC_DIR / s) for s in SOURCES[kind] if not s.endswith(".h")], build_directory=str(directory),
            extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, extra_include_paths=[str(CSRC_DIR)], verbose=verbose,
        )
    except Exception as error:  # compiler errors arrive as RuntimeError / CalledProcessError
        text = str(error)
        lines = [ln[ln.find("error:"):].strip() for ln in text.splitlines() if "error:" in ln]  # the compiler's own
        raise NativeUnavailable(f"build failed: {' | '.join(lines[:3]) or text[:300]}") from error


def _cuda_through_cupy():
    """The CUDA kernels compiled by NVRTC for the current device; raises :class:`NativeUnavailable`."""
    try:
        import cupy
    except ImportError as error:
        absent = isinstance(error, ModuleNotFoundError) and error.name == "cupy"  # the optional gpu extra
        reason = "cupy is not installed (pip install -e '.[gpu]')" if absent else f"cupy does not import: {error}"
        raise NativeUnavailable(reason, missing_tool=absent) from error
    from ddlscale.sync.sparse.cuda_ops import CudaOps

    try:
        return CudaOps(cupy)
    except Exception as error:  # NVRTC's compile log, a missing libnvrtc, a driver cupy cannot use
        first = next((ln.strip() for ln in str(error).splitlines() if "error" in ln.lower()), str(error)[:300])
        raise NativeUnavailable(f"cupy could not compile ddlscale/csrc/zen_cuda.cu: {type(error).__name__}: {first}") \
            from error


# kind -> loaded extension or None; tests swap in a fresh dict to load again.
_loaded: dict[str, Any] = {}
_reasons: dict[str, str] = {}
_lock = threading.Lock()  # one load attempt, hence one warning, per process


def _ops(kind: str) -> Any:
    loaded = _loaded
    if kind in loaded:
        return loaded[kind]
    with _lock:
        if kind not in loaded:
            loaded[kind] = _load(kind)
    return loaded[kind]


def _load(kind: str) -> Any:
    if os.environ.get("DDLSCALE_NATIVE", "1") == "0":
        reason = "disabled by DDLSCALE_NATIVE=0"
    elif kind == "cuda" and not torch.cuda.is_available():
        _reasons[kind] = "no CUDA device"
        return None  # nothing to warn about: CPU-only machines never wanted it
    else:
        try:
            return build(kind)
        except NativeUnavailable as error:
            reason = str(error)
            if kind == "cuda" and error.missing_tool:
                _reasons[kind] = reason
                return None  # the gpu extra was not asked for: the references are the documented default
    _reasons[kind] = reason
    warnings.warn(f"ddlscale native {kind} kernels unavailable ({reason}); using the pure-PyTorch references",
                  NativeKernelWarning, stacklevel=4)
    return None


def cpu_ops() -> ModuleType | None:
    return _ops("cpu")


def cuda_ops() -> CudaOps | None:
    return _ops("cuda")


def unavailable_reason(kind: str = "cpu") -> str | None:
    """Why ``kind``'s kernels are not loaded (after a load was attempted), or None when they are."""
    return None if _ops(kind) is not None else _reasons.get(kind)


def ops_for(op: str, *tensors: torch.Tensor, device: str | None = None, numel: int | None = None):
    """The extension to run ``op`` on these tensors (or on a size on ``device``), or None for the reference."""
    device = device or tensors[0].device.type
    numel = tensors[0].numel() if numel is None else numel
    threshold = NATIVE_FROM.get((device, op))
    if threshold is None or numel < threshold:
        return None
    if any(t.device.type != device or t.layout != torch.strided for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None  # the kernels have no backward
    return cuda_ops() if device == "cuda" else cpu_ops()
