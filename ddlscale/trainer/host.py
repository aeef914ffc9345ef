"""Host-side allocator settings for training processes.

glibc serves a large allocation (above its mmap threshold, 128 KiB to 32 MiB as it adapts) from fresh
pages and returns them to the OS when freed, and it trims the heap's free top the same way. Every
gradient-sized temporary then pays a page fault per 4 KiB on first touch. Here (a VM) that is most
of the cost of decoding a fused group: four 2.7 M-element efsignsgd payloads decoded and summed took
50 ms with glibc's defaults and 10 ms with freed memory kept — the same arithmetic. PyTorch's CPU
tensors have no caching allocator of their own (its tuning guide suggests jemalloc or tcmalloc
instead); keeping freed memory in the process is the same idea with nothing to install.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc's mallopt parameters (malloc.h) and the environment variables its start-up reads.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 1 << 30  # larger than any gradient buffer here
TRIM_THRESHOLD = 1 << 62
ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


def keep_freed_memory() -> bool:
    """Make this process and the ones it starts keep freed memory for reuse (glibc): allocations up
    to 1 GiB come from the heap and the heap is never trimmed. True where it took effect here
    (glibc found); child processes get it from the environment either way."""
    os.environ.update(ENVIRONMENT)
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Older glibc caps the mmap threshold at 32 MiB; mallopt takes an int, and the largest trim
    # threshold it takes never trims either.
    mapped = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) or mallopt(M_MMAP_THRESHOLD, 32 << 20)
    return bool(mapped) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
