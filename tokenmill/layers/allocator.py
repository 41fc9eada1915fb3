"""Freed activation memory kept for the next step (`--retain-freed-memory`, on by default).

glibc's malloc gives the top of its heap back to the kernel once more than
M_TRIM_THRESHOLD bytes lie free there, and serves blocks above M_MMAP_THRESHOLD from
fresh mappings that a free unmaps; both thresholds move with the sizes it has seen. A
prefill step's activations, tens of MB per layer, were so given back and faulted in
again, page by page and zeroed, step after step: 96,000-185,000 page faults in every
32 x 128-token prefill of the 0.5B shape. With the thresholds fixed (mappings only from
32 MB up, the most glibc allows, and the heap trimmed only past 512 MB free) a few
are left once the heap has grown, and that prefill ran 1-4% faster, its peak memory
unchanged (docs/BENCHMARKS.md).
What it costs: memory a step freed stays with the process, up to the activations' peak
that the next step needs again. vLLM's CPU guide preloads TCMalloc for the same reason.

Nothing changes off glibc, under another preloaded allocator, or where the user set
glibc's own malloc tunables (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_,
GLIBC_TUNABLES): theirs win.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_FROM = 32 * 2**20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_PAST = 512 * 2**20
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def why_not(environ=os.environ) -> str | None:
    """Why the thresholds are left alone here, or None where they are set."""
    if platform.libc_ver()[0] != "glibc":
        return "not glibc"
    for name in USER_SETTINGS:
        if environ.get(name):
            return f"{name} is set"
    preload = environ.get("LD_PRELOAD", "")
    for name in OTHER_ALLOCATORS:
        if name in preload:
            return f"{name} is preloaded"
    return None


@functools.cache
def retain_freed_memory() -> bool:
    """Fix glibc's trim and mapping thresholds for this process (once); True if set."""
    if why_not() is not None:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_FROM)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                       TRIM_PAST))
