"""Causal attention of fresh prefill chunks (no cached context): the paged-native
backend's kernel (csrc/prefill_causal.cpp, all of a step's chunks in one call, K/V read
from the paged cache) against torch's fused SDPA kernel (one call per chunk on the
step's own K/V, as the `paged` backend runs them).

Per --shapes "B:n" (B chunks of n tokens), on the --heads / --kv-heads / --head-dim
shape (the 0.5B shape's by default): the two alternated, best of --rounds; GFLOP/s
counts the scores and weighted sums a causal chunk needs (2 x n x n x heads x head_dim).

    python benchmarks/bench_prefill_causal.py [--shapes 32:128 4:512 1:2048]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from tokenmill.attention import prefill_native
from tokenmill.attention.paged import PrefillChunk
from tokenmill.attention.prefill_native import native_prefill
from tokenmill.bench.ceilings import machine_ceilings
from tokenmill.layers.timing import best_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=[
        "32:128", "8:256", "4:512", "1:1024", "1:2048", "1:4096", "1:8192"])
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = native_prefill()
    if kernel is None:
        raise SystemExit("the prefill kernel could not be built on this machine")
    ceilings = machine_ceilings(args.threads)
    print(f"torch {torch.__version__}; {ceilings.machine}, {args.threads} threads; ceilings "
          f"{ceilings.matmul_gflops:.1f} GFLOP/s fp32 GEMM, {ceilings.bandwidth_gbs:.1f} GB/s; "
          f"kernel vectors of {kernel.lanes()} floats")
    print("B x n       | kernel ms (GFLOP/s) | SDPA ms (GFLOP/s) | SDPA / kernel")
    generator = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        count, n = map(int, shape.split(":"))
        ours, theirs = measure(kernel, args, count, n, generator)
        flops = count * 2 * n * n * args.heads * args.head_dim
        print(f"{count:>3} x {n:<5} | {ours * 1e3:9.2f} ({flops / ours / 1e9:4.0f})    | "
              f"{theirs * 1e3:8.2f} ({flops / theirs / 1e9:4.0f})  | {theirs / ours:.2f}x",
              flush=True)


def measure(kernel, args: argparse.Namespace, count: int, n: int,
            generator: torch.Generator) -> tuple[float, float]:
    """(kernel seconds, SDPA seconds) for `count` chunks of n tokens with no context
    (their K/V in a paged cache of 16-token blocks, shuffled, as the kernel reads them)."""
    rows, block_size = count * n, 16
    # Strided rows of one fused projection, as the model hands them over.
    fused = torch.randn(rows, args.heads + 2 * args.kv_heads, args.head_dim,
                        generator=generator)
    q, k, v = fused.split((args.heads, args.kv_heads, args.kv_heads), dim=1)
    per_chunk = -(-n // block_size)
    order = torch.randperm(count * per_chunk, generator=generator)
    tables = [order[i * per_chunk:(i + 1) * per_chunk] for i in range(count)]
    caches = [torch.zeros(count * per_chunk, block_size, args.kv_heads, args.head_dim)
              for _ in range(2)]
    for i, table in enumerate(tables):
        for cache, x in zip(caches, (k, v), strict=True):
            padded = torch.zeros(per_chunk * block_size, args.kv_heads, args.head_dim)
            padded[:n] = x[i * n:(i + 1) * n]
            cache[table] = padded.view(per_chunk, block_size, args.kv_heads, args.head_dim)
    out = torch.empty(rows, args.heads, args.head_dim)
    starts = [i * n for i in range(count)]
    batch = prefill_native.prepare([PrefillChunk(start, start + n, 0, table)
                                    for start, table in zip(starts, tables, strict=True)], [])

    def native():
        prefill_native.run(kernel, q, caches[0], caches[1], out, batch, 0.125)

    def sdpa():
        for start in starts:
            F.scaled_dot_product_attention(
                *(x[start:start + n].transpose(0, 1)[None] for x in (q, k, v)),
                is_causal=True, scale=0.125, enable_gqa=True)

    native()
    expected = torch.cat([F.scaled_dot_product_attention(
        *(x[start:start + n].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True,
        scale=0.125, enable_gqa=True)[0].transpose(0, 1) for start in starts])
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    times = {native: float("inf"), sdpa: float("inf")}
    for _ in range(2):  # alternate the two
        for fn in times:
            times[fn] = min(times[fn], best_seconds(fn, args.rounds))
    return times[native], times[sdpa]


if __name__ == "__main__":
    main()
