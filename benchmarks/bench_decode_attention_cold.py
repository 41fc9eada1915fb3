"""Decode attention per layer with a cold cache, as the engine meets it: every layer's
KV pool is read once per step, after the other layers' products have pushed it out of
the caches, so a step's attention streams its keys and values from memory.

--layers separate pools (the engine's layers; 24 x 32 requests x 160 tokens of the
0.5B shape is 126 MB, four times this host's L3) are filled with random K/V in
shuffled blocks; one timed "step" runs the kernel once per layer, in layer order.
Kernel builds compared (`--variants NAME:FLAGS,...`, each a build of
csrc/paged_decode.cpp with extra compiler flags, e.g. the burst prefetch the kernel
had before `burst:-DTM_PREFETCH_BURST`) run in interleaved rounds; outputs are
checked equal. Reports ms per layer and the K/V read rate against the host's stream
bandwidth (the measured ceiling in the tune cache).

    python benchmarks/bench_decode_attention_cold.py [--batch 32] [--context 160]
        [--layers 24] [--rounds 5] [--variants spread:,burst:-DTM_PREFETCH_BURST]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from tokenmill.attention.paged_native import SOURCE
from tokenmill.kv import KVCache
from tokenmill.layers.native import build_extension

BLOCK = 16
READER = Path(__file__).resolve().parent / "csrc" / "block_read.cpp"


def pools(layers: int, batch: int, context: int, kv_heads: int, head_dim: int):
    blocks_per_row = -(-context // BLOCK)
    total = batch * blocks_per_row + 1
    caches, tables = [], []
    for layer in range(layers):
        cache = KVCache.allocate(total, BLOCK, kv_heads, head_dim, torch.float32,
                                 torch.float32, torch.device("cpu"))
        cache.data.normal_()
        order = list(range(1, total))
        random.Random(layer).shuffle(order)
        caches.append(cache)
        tables.append(torch.tensor(order, dtype=torch.int64).view(batch, blocks_per_row))
    return caches, tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default="spread:,burst:-DTM_PREFETCH_BURST")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = {}
    for entry in args.variants.split(","):
        name, _, flags = entry.partition(":")
        kernels[name] = build_extension(f"paged_decode_{name}", SOURCE,
                                        ("-ffast-math", *flags.split()))
        if kernels[name] is None:
            raise SystemExit(f"variant {name} did not build")
    caches, tables = pools(args.layers, args.batch, args.context, args.kv_heads,
                           args.head_dim)
    lengths = torch.full((args.batch,), args.context, dtype=torch.int64)
    q = torch.randn(args.batch, args.heads, args.head_dim)
    scale = args.head_dim ** -0.5
    reference = None
    for kernel in kernels.values():
        out = kernel.paged_decode(q, caches[0].data[0], caches[0].data[1], tables[0],
                                  lengths, scale)
        if reference is None:
            reference = out
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    # The ceiling: the same blocks read (and summed) in the same order, nothing else.
    reader = build_extension("block_read", READER)
    times: dict[str, list[float]] = {name: [] for name in kernels}
    read_times: list[float] = []
    for _ in range(args.rounds):
        if reader is not None:
            start = time.perf_counter()
            for layer in range(args.layers):
                reader.block_read(caches[layer].data[0], caches[layer].data[1], tables[layer])
            read_times.append((time.perf_counter() - start) / args.layers)
        for name, kernel in kernels.items():
            start = time.perf_counter()
            for layer in range(args.layers):
                kernel.paged_decode(q, caches[layer].data[0], caches[layer].data[1],
                                    tables[layer], lengths, scale)
            times[name].append((time.perf_counter() - start) / args.layers)
    kv_bytes = args.batch * args.context * 2 * args.kv_heads * args.head_dim * 4
    print(f"batch {args.batch} x {args.context} tokens, {args.layers} layers "
          f"({kv_bytes * args.layers / 1e6:.0f} MB of K/V a step), {args.threads} threads")
    if read_times:
        per_layer = statistics.median(read_times)
        print(f"  {'read only':10s} {per_layer * 1e3:7.3f} ms per layer  "
              f"{kv_bytes / per_layer / 1e9:5.1f} GB/s  (the same blocks summed: the "
              "ceiling)")
    base = statistics.median(times[next(iter(kernels))])
    for name, values in times.items():
        per_layer = statistics.median(values)
        print(f"  {name:10s} {per_layer * 1e3:7.3f} ms per layer  "
              f"{kv_bytes / per_layer / 1e9:5.1f} GB/s  "
              f"(first variant / this: {base / per_layer:.2f}x; rounds "
              f"{', '.join(f'{v * 1e3:.3f}' for v in values)})")


if __name__ == "__main__":
    main()
