"""A large batch through a row-wise block a slice of rows at a time (`--mlp-slice-rows`).

A gated MLP's intermediate activations are several times wider than the residual
stream: a 2048-token prefill chunk of the Qwen2.5-0.5B shape makes an 80 MB gate/up
output in every layer. Buffers that large come from fresh pages on every call (glibc
maps anything over 32 MB anew, and the OS zeroes each page on first touch), and they
leave the last-level cache before the next product reads them. Run a few hundred rows
at a time instead and each slice's intermediates stay cache-sized, their buffers reused
from slice to slice. Rows are independent in an MLP, so the result is the same
(bit-identical where a product's rows do not depend on each other, as in the native
kernel). How many rows: `auto_slice_rows`, from this host's last-level cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

# The slice's widest intermediate is sized to a third of the last-level cache (the
# rest holds the weights streaming through and the slice's input and output).
CACHE_SHARE = 3
# Without a cache size to go by (no sysfs): the rows that fit a 32 MB L3.
FALLBACK_BYTES = 32 * 2**20
# The most cache a slice is sized to: a virtual machine may report its host's whole
# last-level cache (480 MB on one Intel host, shared with every other guest), where
# sized so 0.5B-shape prefill took no slices and ran 2-3% slower than in 512-row ones
# (docs/BENCHMARKS.md).
MAX_CACHE_BYTES = 64 * 2**20
ROW_STEP = 64  # slices in multiples of 64 rows (whole row tiles of every kernel)


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


@functools.cache
def last_level_cache_bytes() -> int:
    """Size of the CPU's largest cache level from sysfs (a fallback where unreadable)."""
    best: tuple[int, int] | None = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
            size = int(text[:-1]) * _UNITS[text[-1]] if text[-1:] in _UNITS else int(text)
        except (OSError, ValueError):
            continue
        if best is None or level > best[0]:
            best = (level, size)
    return best[1] if best else FALLBACK_BYTES


def auto_slice_rows(row_bytes: int, cache_bytes: int | None = None) -> int:
    """Rows per slice for an intermediate of `row_bytes` per row: as many as fit
    1/CACHE_SHARE of the last-level cache (at most MAX_CACHE_BYTES of it), in multiples
    of ROW_STEP (at least one)."""
    cache_bytes = min(cache_bytes or last_level_cache_bytes(), MAX_CACHE_BYTES)
    rows = cache_bytes // CACHE_SHARE // max(row_bytes, 1)
    return max(ROW_STEP, rows // ROW_STEP * ROW_STEP)


def in_row_slices(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int,
                  out_features: int) -> torch.Tensor:
    """fn(x) for a row-wise fn ([n, in] -> [n, out_features]), computed `rows` rows at a
    time into one output."""
    out = x.new_empty(x.shape[0], out_features)
    for start in range(0, x.shape[0], rows):
        out[start:start + rows] = fn(x[start:start + rows])
    return out


def set_mlp_slice_rows(model: nn.Module, setting: int | None, itemsize: int,
                       device: torch.device) -> list[int]:
    """Give every sliceable MLP of `model` its slice (`setting` rows; None: on the CPU
    sized from the cache for its width, elsewhere none; 0: none) and return the
    distinct slices set (none: []). A sliceable module has `slice_rows` and
    `intermediate_bytes_per_row(itemsize)`."""
    chosen: set[int] = set()
    for module in model.modules():
        if not hasattr(module, "slice_rows"):
            continue
        if setting is None:
            module.slice_rows = (auto_slice_rows(module.intermediate_bytes_per_row(itemsize))
                                 if device.type == "cpu" else 0)
        else:
            module.slice_rows = setting
        chosen.add(module.slice_rows)
    return sorted(chosen - {0})
