"""How far ahead the native kernel fetches a few rows' weights, measured per host.

A product of a few rows (a decode step's) streams its weights from memory, each of a
row tile's block streams fetched `stream_ahead` columns (64-byte lines) ahead of the
column it multiplies (csrc/f32_tiles.h). The build's distance, 64, was measured
against no fetch; on an Intel AVX-512 host 16-48 columns read a one-row step's products
1.03-1.05x faster and ran its whole step 1.03-1.05x faster (docs/BENCHMARKS.md), and
which distance wins depends on the memory's latency and the cores' fill buffers.
The best distance also moves with the rows: on a Zen 4 host one row read fastest at 16
columns (1.14x against 48) and 8 rows at 48 (1.20x against 16), so the kernel keeps two,
one for lone tiles of up to `native_linear.one_ahead_rows()` rows and one for more.
`tokenmill tune` times passes over the model's products, from memory, at each candidate
distance, at one row and at MANY_ROWS rows, and stores the fastest of each for this
host, kernel build and thread count; an engine on the native kernel takes them at
start-up (`native_stream_ahead`), the build's where nothing is stored or
TOKENMILL_AUTO_TUNE=0.
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
MANY_ROWS = 8  # a decode step of several streams (lone tiles of more than 4 rows)
MARGIN = 0.98  # another distance must be 2% faster than the build's to replace it


def table_path(threads: int) -> Path:
    return CACHE / "products" / f"{host_key(threads)}-{threads}t-native-fetch.json"


def choose(seconds: dict[int, float], built: int) -> int:
    """The fastest distance if it beats the build's by more than the margin (ties and
    near-ties stay with the build's)."""
    fastest = min(seconds, key=lambda d: (seconds[d], d != built))
    return fastest if seconds[fastest] < MARGIN * seconds.get(built, math.inf) else built


def measure(shapes: list[tuple[int, int]], threads: int, copies: int = 1,
            repeats: int = 5, rows: int = ROWS) -> dict[int, float]:
    """Seconds for one pass of native products over `copies` copies of `shapes` ([out,
    in] weights) at `rows` rows, per candidate distance (of that row count's class), the
    candidates alternating pass by pass; the fastest of `repeats` passes each after a
    warm-up."""
    return time_native_settings(shapes, rows, threads, CANDIDATES,
                                lambda d: native_linear.set_stream_ahead(d, rows),
                                lambda: native_linear.stream_ahead(rows), repeats, copies)


def write(threads: int, seconds: dict[int, float], shape: str,
          many_seconds: dict[int, float] | None = None) -> dict:
    """Stores the choice at one row and (where timed) at MANY_ROWS rows; a class not
    timed keeps the build's distance."""
    built = native_linear.built_stream_ahead()
    entry = {"source": "tune", "shape": shape, "threads": threads, "rows": ROWS,
             "kernel": native_linear.build_name(), "built": built,
             "seconds": {str(d): s for d, s in seconds.items()},
             "stream_ahead": choose(seconds, built), "many_rows": MANY_ROWS,
             "many_seconds": {str(d): s for d, s in (many_seconds or {}).items()},
             "stream_ahead_many": choose(many_seconds, built) if many_seconds else built}
    write_json(table_path(threads), entry)
    return entry


def read(threads: int) -> dict | None:
    """The stored measurement if this build of the kernel made it (and its choices are
    ones a measurement can make: a candidate or the build's)."""
    entry = read_json(table_path(threads))
    if entry is None or entry.get("kernel") != native_linear.build_name():
        return None
    choices = {*CANDIDATES, native_linear.built_stream_ahead()}
    valid = all(type(entry.get(key)) is int and entry[key] in choices
                for key in ("stream_ahead", "stream_ahead_many"))
    return entry if valid else None


def native_stream_ahead(threads: int | None = None) -> tuple[int, int]:
    """The distances the native kernel takes on this host, (up to one_ahead_rows rows,
    more): the ones `tokenmill tune` stored, else the build's."""
    built = native_linear.built_stream_ahead()
    if os.environ.get("TOKENMILL_AUTO_TUNE", "1") == "0":
        return built, built
    entry = read(threads or torch.get_num_threads())
    return (built, built) if entry is None else (entry["stream_ahead"],
                                                 entry["stream_ahead_many"])


def configure(threads: int | None = None) -> None:
    """Sets the kernel's two distances to this host's (`native_stream_ahead`)."""
    one, many = native_stream_ahead(threads)
    native_linear.set_stream_ahead(one, ROWS)
    native_linear.set_stream_ahead(many, MANY_ROWS)


def format_entry(entry: dict) -> str:
    lines = []
    for rows, key, choice in ((entry["rows"], "seconds", "stream_ahead"),
                              (entry["many_rows"], "many_seconds", "stream_ahead_many")):
        seconds = {int(d): s for d, s in entry[key].items()}
        cells = ", ".join(f"{d}: {s * 1e3:.2f}" for d, s in sorted(seconds.items()))
        lines.append(f"native fetch distance ({entry['source']}, {rows} row{'s' * (rows > 1)}, "
                     f"ms per pass by columns ahead): {cells or 'not timed'} -> "
                     f"{entry[choice]} (build: {entry['built']})")
    return "\n".join(lines)
