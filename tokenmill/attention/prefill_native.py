"""Causal attention of a step's prefill chunks through the native kernel
(csrc/prefill_causal.cpp), for sequences (cached context + chunk) up to a length
measured on this machine; the paged-native backend takes it.

The kernel takes all of the chunks in one call and reads keys and values where they lie
in the paged cache (the step's own K/V already written there), so a chunk behind a
cached context needs no gather: each chunk's keys are transposed once per KV head out
of its blocks; a work item is one chunk's block of BLOCK_POSITIONS query positions for
one KV head, whose query heads' rows take their scores as one small matrix product, a
softmax per row over the keys its position sees, and the weighted values as a second
product, over the keys in passes of KEY_BLOCK with a running softmax. Against torch's
fused kernel it is 1.4-2x faster at 128-512 tokens on the 0.5B shape's heads; on
longer sequences it depends on the host: with AVX-512 it stayed ahead up to 8K tokens,
under AVX2 (half the registers, smaller tiles) it fell behind from 2-4K on the same Zen
4 (docs/BENCHMARKS.md). So at start-up the backend times both on one chunk of 128, 256,
... MAX_PROBE tokens with the model's head geometry, and the kernel takes sequences up to
the longest length to which it was no slower at every length (cached per host, threads,
geometry and kernel build; about a second, once). Longer ones take the paged path.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.attention.paged import PrefillChunk
from tokenmill.layers.native import build_extension, build_key
from tokenmill.layers.product_table import host_key
from tokenmill.layers.timing import CACHE

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "prefill_causal.cpp"
FLAGS = ("-ffast-math",)
BLOCK_POSITIONS = 16  # query positions per work item (x the query heads of a KV head)
KEY_BLOCK = 256  # keys per pass of the running softmax (a pass's scores stay in cache)
MAX_PROBE = 2048  # longest sequence timed (and so the longest the kernel ever takes)
REPEATS = 3
WARM_UP = 1


@functools.cache  # (no arguments: a lookup per layer costs nothing)
def native_prefill():
    """The compiled kernel, or None where it cannot be built."""
    return build_extension("prefill_causal", SOURCE, FLAGS)


@dataclass(frozen=True)
class PrefillBatch:
    """A step's chunks for the kernel, prepared once per step (not per layer): their
    block tables padded to one width, and each one's context, first row and length;
    `rest` the step's other chunks (the paged path's)."""

    tables: torch.Tensor  # [C, W] int64
    contexts: torch.Tensor  # [C] int64
    starts: torch.Tensor
    lengths: torch.Tensor
    rest: list[PrefillChunk]


def prepare(chunks: list[PrefillChunk], rest: list[PrefillChunk]) -> PrefillBatch:
    width = max(len(chunk.block_table) for chunk in chunks)
    tables = torch.zeros(len(chunks), width, dtype=torch.int64)
    for row, chunk in enumerate(chunks):
        tables[row, :len(chunk.block_table)] = chunk.block_table
    columns = [[c.context_len for c in chunks], [c.start for c in chunks],
               [c.end - c.start for c in chunks]]
    return PrefillBatch(tables, *(torch.tensor(x, dtype=torch.int64) for x in columns),
                        rest)


def run(kernel, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        out: torch.Tensor, batch: PrefillBatch, scale: float) -> None:
    """Each chunk's attention (its query rows of q [T, heads, D], each row's heads
    contiguous; keys and values in the caches [blocks, block_size, KVH, D] through its
    block table) into the same rows of out (contiguous)."""
    kernel.causal_prefill(q, key_cache, value_cache, out, batch.tables, batch.contexts,
                          batch.starts, batch.lengths, scale, BLOCK_POSITIONS, KEY_BLOCK)


def choose_limit(table: dict[int, tuple[float, float]]) -> int:
    """table {length: (kernel seconds, torch seconds)} -> the longest length up to which
    the kernel was no slower at every measured length (0: not even the shortest)."""
    limit = 0
    for length in sorted(table):
        kernel, torch_seconds = table[length]
        if kernel > torch_seconds:
            break
        limit = length
    return limit


def measure_table(kernel, heads: int, kv_heads: int, head_dim: int
                  ) -> dict[int, tuple[float, float]]:
    """{length: (kernel, torch) seconds of one chunk's causal attention}."""
    generator = torch.Generator().manual_seed(0)
    time_chunk(kernel, 128, heads, kv_heads, head_dim, generator)  # the process's first calls
    table = {}
    length = 128
    while length <= MAX_PROBE:
        table[length] = time_chunk(kernel, length, heads, kv_heads, head_dim, generator)
        length *= 2
    return table


def time_chunk(kernel, length: int, heads: int, kv_heads: int, head_dim: int,
               generator: torch.Generator, block_size: int = 16) -> tuple[float, float]:
    """(kernel, torch) seconds of one chunk of `length` random tokens with no context:
    the best of REPEATS calls each, the two alternated after WARM_UP calls of each
    (measure_table runs a throw-away round first: the first calls in a process pay for
    thread start-up and first touches, and a median of 3 once read 2.07 ms for a
    0.42 ms call and chose torch everywhere)."""
    # Strided rows of one fused projection, as the model hands them over; its K/V in a
    # cache of blocks in order.
    fused = torch.randn(length, heads + 2 * kv_heads, head_dim, generator=generator)
    q, k, v = fused.split((heads, kv_heads, kv_heads), dim=1)
    blocks = -(-length // block_size)
    caches = [torch.zeros(blocks * block_size, kv_heads, head_dim) for _ in range(2)]
    caches[0][:length], caches[1][:length] = k, v
    key_cache, value_cache = (c.view(blocks, block_size, kv_heads, head_dim) for c in caches)
    batch = prepare([PrefillChunk(0, length, 0, torch.arange(blocks))], [])
    out = torch.empty(length, heads, head_dim)
    scale = head_dim ** -0.5
    calls = (lambda: run(kernel, q, key_cache, value_cache, out, batch, scale),
             lambda: F.scaled_dot_product_attention(
                 *(x.transpose(0, 1)[None] for x in (q, k, v)), is_causal=True,
                 scale=scale, enable_gqa=True))
    for call in calls:
        for _ in range(WARM_UP):
            call()
    best = [float("inf"), float("inf")]
    for _ in range(REPEATS):
        for index, call in enumerate(calls):
            started = time.perf_counter()
            call()
            best[index] = min(best[index], time.perf_counter() - started)
    ours, theirs = best
    return ours, theirs


def table_dir(threads: int) -> Path:
    return CACHE / "prefill" / f"{host_key(threads)}-{threads}t"


def stored_tables(threads: int) -> dict[str, dict[int, tuple[float, float]]]:
    """{"heads-kv_heads-head_dim": table} measured on this host at `threads` threads
    with the current kernel."""
    tables = {}
    for path in sorted(table_dir(threads).glob(f"*-{build_key(SOURCE, FLAGS)[:8]}.json")):
        geometry = "-".join(path.stem.split("-")[:3])
        tables[geometry] = {int(n): tuple(t) for n, t in json.loads(path.read_text()).items()}
    return tables


def format_table(geometry: str, table: dict[int, tuple[float, float]]) -> str:
    heads, kv_heads, head_dim = geometry.split("-")
    lines = [f"causal prefill kernel, {heads} query / {kv_heads} KV heads of {head_dim}: "
             "ms per layer for one chunk",
             "| tokens | kernel | torch SDPA | torch / kernel |", "| --- | --- | --- | --- |"]
    for n, (ours, theirs) in sorted(table.items()):
        lines.append(f"| {n} | {ours * 1e3:.2f} | {theirs * 1e3:.2f} | {theirs / ours:.2f}x |")
    limit = choose_limit(table)
    lines.append(f"choice: the kernel takes sequences up to {limit} tokens" if limit
                 else "choice: torch's kernel for every chunk")
    return "\n".join(lines)


def longest_sequence(kernel, heads: int, kv_heads: int, head_dim: int) -> int:
    """The cached or freshly measured longest sequence (context + chunk) the kernel
    takes here."""
    threads = torch.get_num_threads()
    # The kernel's build key: a changed kernel is timed again.
    build = build_key(SOURCE, FLAGS)[:8]
    path = (table_dir(threads)
            / f"{heads}-{kv_heads}-{head_dim}-{KEY_BLOCK}-{BLOCK_POSITIONS}-{build}.json")
    if path.is_file():
        table = {int(n): tuple(t) for n, t in json.loads(path.read_text()).items()}
    else:
        table = measure_table(kernel, heads, kv_heads, head_dim)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({str(n): t for n, t in table.items()}))
    limit = choose_limit(table)
    logger.info("causal prefill kernel: sequences up to %d tokens (kernel/torch per "
                "layer: %s)", limit, ", ".join(f"{n}: {a * 1e3:.2f}/{b * 1e3:.2f} ms"
                                               for n, (a, b) in table.items()))
    return limit
