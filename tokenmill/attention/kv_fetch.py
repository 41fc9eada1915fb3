"""Which cache the decode kernel prefetches the next tile's keys and values into,
measured per host.

In the engine every layer's KV pool is read once per step after the other layers'
weights have pushed it out of the caches, so decode attention streams its keys and
values from memory, the next 16-token tile's lines prefetched while the current one is
folded (csrc/decode_tile.h). Into L1 (`prefetcht0`, the build's) or into L2 only
(`prefetcht1`): on a Zen 4 host the AVX-512 kernel read a cold cache 1.17-1.42x faster
into L2, the same host's AVX2 build 0.92x as fast at 32 requests x 160 tokens and
1.09-1.13x at longer contexts (docs/BENCHMARKS.md), so neither is a default to assume. At start-up the paged-native backend times both on
pools far beyond the caches (`measure`: the levels alternating pass by pass) and sets
the faster; the result is kept per host, thread count, head geometry and kernel build,
so a host measures once (under a second). TOKENMILL_AUTO_TUNE=0 keeps the build's.
"""

from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path

import torch

from tokenmill.layers.fetch_distance import choose  # the same rule: 2% past the build's
from tokenmill.layers.isa import kernel_flags
from tokenmill.layers.native import build_key
from tokenmill.layers.product_table import host_key, measured_once, read_json, write_json
from tokenmill.layers.row_slices import last_level_cache_bytes
from tokenmill.layers.timing import CACHE

logger = logging.getLogger(__name__)

LEVELS = (1, 2)  # 1: into L1 (prefetcht0); 2: into L2 only (prefetcht1)
ROWS = 8  # a decode step's requests
LAYERS = 24  # pools read in turn, one per layer, as a step reads them
POOL_BYTES = 96 * 2**20  # K/V over all the layers, at least (and 3x the last-level cache)
MAX_POOL_BYTES = 384 * 2**20  # ... at most (a start-up's passing allocation)
BLOCK = 16  # tokens per block of the measured pools
ROUNDS = 5  # timed rounds (after one warm-up), each level once a round


def pool_bytes() -> int:
    """K/V bytes the measured pools hold: POOL_BYTES, or 3x a larger last-level cache
    (up to MAX_POOL_BYTES)."""
    return min(MAX_POOL_BYTES, max(POOL_BYTES, 3 * last_level_cache_bytes()))


def context_for(kv_heads: int, head_dim: int) -> int:
    """Tokens per request in the measured pools: pool_bytes() over every layer and row,
    whole blocks, at least 4 of them."""
    token_bytes = 2 * kv_heads * head_dim * 4
    tokens = pool_bytes() // (LAYERS * ROWS * token_bytes)
    return max(4 * BLOCK, -(-tokens // BLOCK) * BLOCK)


@torch.inference_mode()
def measure(kernel, heads: int, kv_heads: int, head_dim: int,
            rounds: int = ROUNDS) -> dict[int, float]:
    """Seconds for one pass over LAYERS cold pools (ROWS requests each, their blocks
    shuffled through the pool) at each prefetch level, the levels alternating pass by
    pass; the fastest of `rounds` passes each after a warm-up. The kernel's level is
    restored after."""
    context = context_for(kv_heads, head_dim)
    per_row = context // BLOCK
    blocks = ROWS * per_row
    generator = torch.Generator().manual_seed(0)
    shuffle = random.Random(0)
    layers = []
    for _ in range(LAYERS):
        keys = torch.rand(blocks, BLOCK, kv_heads, head_dim, generator=generator)
        values = torch.rand(blocks, BLOCK, kv_heads, head_dim, generator=generator)
        order = list(range(blocks))
        shuffle.shuffle(order)
        tables = torch.tensor(order, dtype=torch.int64).view(ROWS, per_row)
        layers.append((keys, values, tables))
    q = torch.rand(ROWS, heads, head_dim, generator=generator)
    lengths = torch.full((ROWS,), context, dtype=torch.int64)
    scale = head_dim ** -0.5
    seconds: dict[int, list[float]] = {level: [] for level in LEVELS}
    before = kernel.fetch_level()
    try:
        for _ in range(rounds + 1):  # the first round warms up
            for level in LEVELS:
                kernel.set_fetch_level(level)
                started = time.perf_counter()
                for keys, values, tables in layers:
                    kernel.paged_decode(q, keys, values, tables, lengths, scale)
                seconds[level].append(time.perf_counter() - started)
    finally:
        kernel.set_fetch_level(before)
    return {level: min(times[1:]) for level, times in seconds.items()}


def folder(threads: int) -> Path:
    return CACHE / "kv_fetch" / f"{host_key(threads)}-{threads}t"


def table_path(source: Path, flags: tuple[str, ...], heads: int, kv_heads: int,
               head_dim: int, threads: int) -> Path:
    build = build_key(source, (*flags, *kernel_flags()))[:8]
    return folder(threads) / f"{heads}-{kv_heads}-{head_dim}-{build}.json"


def valid(entry: dict | None, built: int | None = None) -> dict | None:
    """The entry if its choice is one a measurement can make, with its timings (and, if
    `built` is given, made by a build of that level)."""
    if (entry is None or entry.get("level") not in LEVELS or entry.get("built") not in LEVELS
            or not isinstance(entry.get("seconds"), dict)
            or (built is not None and entry["built"] != built)):
        return None
    return entry


def configure(kernel, source: Path, flags: tuple[str, ...], heads: int, kv_heads: int,
              head_dim: int) -> int:
    """Sets the kernel's prefetch level to this host's (measured and stored on first
    use; the build's under TOKENMILL_AUTO_TUNE=0); returns it."""
    built = kernel.built_fetch_level()
    if os.environ.get("TOKENMILL_AUTO_TUNE", "1") == "0":
        kernel.set_fetch_level(built)
        return built
    threads = torch.get_num_threads()
    path = table_path(source, flags, heads, kv_heads, head_dim, threads)

    def measure_and_store() -> dict:
        seconds = measure(kernel, heads, kv_heads, head_dim)
        entry = {"seconds": {str(level): s for level, s in seconds.items()},
                 "built": built, "level": choose(seconds, built), "threads": threads}
        write_json(path, entry)
        return entry

    entry = measured_once(path, lambda: valid(read_json(path), built), measure_and_store)
    kernel.set_fetch_level(entry["level"])
    logger.info("decode attention prefetches into L%d (ms per pass: %s)", entry["level"],
                ", ".join(f"L{level} {s * 1e3:.2f}" for level, s in entry["seconds"].items()))
    return entry["level"]


def stored(threads: int) -> dict[str, dict]:
    """{"heads-kv_heads-head_dim-build": entry} measured on this host at `threads` (files
    that do not read as an entry left out)."""
    entries = {path.stem: valid(read_json(path))
               for path in sorted(folder(threads).glob("*.json"))}
    return {name: entry for name, entry in entries.items()
            if entry is not None and len(name.split("-")) == 4}


def format_entry(name: str, entry: dict) -> str:
    heads, kv_heads, head_dim, build = name.split("-")
    cells = ", ".join(f"L{level}: {s * 1e3:.2f}" for level, s in entry["seconds"].items())
    return (f"decode attention prefetch, {heads} query / {kv_heads} KV heads of {head_dim} "
            f"(kernel {build}; ms per pass over cold pools): {cells} -> L{entry['level']} "
            f"(build: L{entry['built']})")
