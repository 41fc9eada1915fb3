"""Weights in transparent huge pages (`--huge-pages`, on by default on Linux).

A decode step streams every weight once. With 4 KB pages that stream crosses a page,
and may miss the TLB, every 4 KB, and the CPU's hardware prefetchers stop at each
page's edge. Asked with madvise(MADV_HUGEPAGE) before the memory is first written,
Linux backs it with 2 MB pages where transparent huge pages are set to `madvise` or
`always` (/sys/kernel/mm/transparent_hugepage/enabled); where they are `never`, on
other systems, or for tensors under 2 MB, nothing changes. Values are unchanged: only
the pages under them differ. The 0.5B shape's gate/up weights streamed 1.07-1.21x
faster so through the native kernel, in one process, alternated (docs/BENCHMARKS.md).

The loader asks inside `for_weights(enabled)`: for every parameter right after it is
allocated (before the checkpoint is copied in), and for the packed copies kernels make
(`empty_like`, native_linear.pack).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import sys
from collections.abc import Iterator

import torch
from torch import nn

MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
PAGE = 4096
MIN_BYTES = 2 * 2**20  # one huge page: smaller tensors cannot hold one

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("huge_pages", default=False)
# Whether the loader lays the natively packed weights out in one arena (weight_arena.py).
_ARENA: contextvars.ContextVar[bool] = contextvars.ContextVar("weight_arena", default=False)


@functools.cache
def _madvise():
    """libc's madvise, or None off Linux (or where it cannot be found)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


@contextlib.contextmanager
def for_weights(enabled: bool, arena: bool = False) -> Iterator[None]:
    """Inside, `advise` asks for huge pages (when `enabled`), and the loader lays the
    weights a kernel packs in place out in one arena (when `arena`: weight_arena.py)."""
    tokens = _ENABLED.set(enabled), _ARENA.set(arena)
    try:
        yield
    finally:
        _ARENA.reset(tokens[1])
        _ENABLED.reset(tokens[0])


def arena_asked() -> bool:
    return _ARENA.get()


def advise(tensor: torch.Tensor) -> bool:
    """Ask for huge pages under `tensor`'s whole storage (inside `for_weights(True)`, on
    the CPU, strided, at least 2 MB); whether the system took the request."""
    if not _ENABLED.get() or tensor.device.type != "cpu" or tensor.layout != torch.strided:
        return False
    storage = tensor.untyped_storage()
    madvise = _madvise()
    if storage.nbytes() < MIN_BYTES or madvise is None:
        return False
    start = storage.data_ptr()
    begin, end = start & ~(PAGE - 1), (start + storage.nbytes() + PAGE - 1) & ~(PAGE - 1)
    return madvise(begin, end - begin, MADV_HUGEPAGE) == 0


def empty_like(tensor: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous tensor like `tensor`, advised before anything is
    written to it."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    advise(out)
    return out


def advise_module(model: nn.Module) -> int:
    """Advise the storage of every parameter and buffer of `model` (once each: the
    weight arena's slots share one); how many the system took."""
    storages = {t.untyped_storage().data_ptr(): t for t in (*model.parameters(),
                                                             *model.buffers())}
    return sum(advise(t) for t in storages.values())
