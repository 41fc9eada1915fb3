"""Causal attention of fresh prefill chunks (no cached context): the paged-native
backend's kernel (csrc/prefill_causal.cpp, all of a step's chunks in one call) against
torch's fused SDPA kernel (one call per chunk, as the `paged` backend runs them).

Per --shapes "B:n" (B chunks of n tokens), on the --heads / --kv-heads / --head-dim
shape (the 0.5B shape's by default): the two alternated, best of --rounds; GFLOP/s
counts the scores and weighted sums a causal chunk needs (2 x n x n x heads x head_dim).

    python benchmarks/bench_prefill_causal.py [--shapes 32:128 4:512 1:2048]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tokenmill.attention.fresh_prefill import BLOCK_POSITIONS, KEY_BLOCK, native_prefill
from tokenmill.bench.ceilings import machine_ceilings


def best_of(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


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
    """(kernel seconds, SDPA seconds) for `count` chunks of n tokens."""
    rows = count * n
    # Strided rows of one fused projection, as the model hands them over.
    fused = torch.randn(rows, args.heads + 2 * args.kv_heads, args.head_dim,
                        generator=generator)
    q, k, v = fused.split((args.heads, args.kv_heads, args.kv_heads), dim=1)
    v = v.contiguous()
    out = torch.empty(rows, args.heads, args.head_dim)
    starts = torch.arange(count) * n
    lengths = torch.full((count,), n)

    def native():
        kernel.causal_prefill(q, k, v, out, starts, lengths, 0.125, BLOCK_POSITIONS,
                              KEY_BLOCK)

    def sdpa():
        for start in starts.tolist():
            F.scaled_dot_product_attention(
                *(x[start:start + n].transpose(0, 1)[None] for x in (q, k, v)),
                is_causal=True, scale=0.125, enable_gqa=True)

    times = {native: float("inf"), sdpa: float("inf")}
    for _ in range(2):  # alternate the two
        for fn in times:
            times[fn] = min(times[fn], best_of(fn, args.rounds))
    return times[native], times[sdpa]

if __name__ == "__main__":
    main()
