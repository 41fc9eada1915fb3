"""How far ahead the native kernel fetches a few rows' weights, measured per host.

A product of a few rows (a decode step's) streams its weights from memory, each of a
row tile's block streams fetched `stream_ahead` columns (64-byte lines) ahead of the
column it multiplies (csrc/f32_tiles.h). The build's distance, 64, was measured
against no fetch; on an Intel AVX-512 host 16-48 columns read a one-row step's products
1.03-1.05x faster and ran its whole step 1.03-1.05x faster (docs/BENCHMARKS.md), and
which distance wins depends on the memory's latency and the cores' fill buffers.
`tokenmill tune` times one-row passes over the model's products, from memory, at each
candidate distance, and stores the fastest for this host, kernel build and thread
count; an engine on the native kernel takes it at start-up (`native_stream_ahead`),
the build's where nothing is stored or TOKENMILL_AUTO_TUNE=0.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from tokenmill.layers import native_linear
from tokenmill.layers.product_table import host_key, read_json, time_native_settings, write_json
from tokenmill.layers.timing import CACHE

CANDIDATES = (0, 16, 32, 48, 64, 96, 128)  # columns; 0: no fetch
ROWS = 1  # a single stream's decode step: its products' time is the weights' stream
MARGIN = 0.98  # another distance must be 2% faster than the build's to replace it


def table_path(threads: int) -> Path:
    return CACHE / "products" / f"{host_key(threads)}-{threads}t-native-fetch.json"


def choose(seconds: dict[int, float], built: int) -> int:
    """The fastest distance if it beats the build's by more than the margin (ties and
    near-ties stay with the build's)."""
    fastest = min(seconds, key=lambda d: (seconds[d], d != built))
    return fastest if seconds[fastest] < MARGIN * seconds.get(built, math.inf) else built


def measure(shapes: list[tuple[int, int]], threads: int, copies: int = 1,
            repeats: int = 5) -> dict[int, float]:
    """Seconds for one pass of native products over `copies` copies of `shapes` ([out,
    in] weights) at one row, per candidate distance, the candidates alternating pass by
    pass; the fastest of `repeats` passes each after a warm-up."""
    return time_native_settings(shapes, ROWS, threads, CANDIDATES,
                                native_linear.set_stream_ahead, native_linear.stream_ahead,
                                repeats, copies)


def write(threads: int, seconds: dict[int, float], shape: str) -> dict:
    built = native_linear.built_stream_ahead()
    entry = {"source": "tune", "shape": shape, "threads": threads, "rows": ROWS,
             "kernel": native_linear.build_name(), "built": built,
             "seconds": {str(d): s for d, s in seconds.items()},
             "stream_ahead": choose(seconds, built)}
    write_json(table_path(threads), entry)
    return entry


def read(threads: int) -> dict | None:
    """The stored measurement if this build of the kernel made it (and its choice is
    one a measurement can make: a candidate or the build's)."""
    entry = read_json(table_path(threads))
    if entry is None or entry.get("kernel") != native_linear.build_name():
        return None
    choice = entry.get("stream_ahead")
    choices = {*CANDIDATES, native_linear.built_stream_ahead()}
    return entry if type(choice) is int and choice in choices else None


def native_stream_ahead(threads: int | None = None) -> int:
    """The distance the native kernel takes on this host: the one `tokenmill tune`
    stored, else the build's."""
    built = native_linear.built_stream_ahead()
    if os.environ.get("TOKENMILL_AUTO_TUNE", "1") == "0":
        return built
    entry = read(threads or torch.get_num_threads())
    return built if entry is None else entry["stream_ahead"]


def format_entry(entry: dict) -> str:
    seconds = {int(d): s for d, s in entry["seconds"].items()}
    cells = ", ".join(f"{d}: {s * 1e3:.2f}" for d, s in sorted(seconds.items()))
    return (f"native fetch distance ({entry['source']}, {entry['rows']} row, ms per pass by "
            f"columns ahead): {cells} -> {entry['stream_ahead']} (build: {entry['built']})")
