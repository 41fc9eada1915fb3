"""Greedy sampling's argmax over a 151936-token vocabulary (the Qwen2.5 shape): torch's
argmax against the compiled row operator the sampler takes on the CPU
(layers/sampler.py `greedy`, layers/csrc/row_ops.cpp), best of 5 x 50 calls, in
inference mode as the engine runs it.

    python benchmarks/bench_argmax.py [--threads 2] [--rows 1 8 32]

--after-head times the compiled argmax as a step meets it instead: on the logits an LM
head of the 0.5B shape (151936 x 896, the native kernel, one row) has just written,
after its 544 MB weight stream (40 heads per thread count, the counts in turn; then the
same call again, warm), at 1 and --threads threads (one thread: the scan before rows
were split into pieces).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill.layers.sampler import greedy
from tokenmill.layers.timing import best_seconds


def per_call(fn) -> float:
    """Seconds per call: the best of 5 runs of 50 calls."""
    return best_seconds(lambda: [fn() for _ in range(50)]) / 50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--after-head", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.after_head:
        return after_head(args.threads, args.vocab)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(rows, args.vocab, generator=generator)
            assert torch.equal(greedy(x), x.argmax(dim=-1))
            theirs = per_call(lambda x=x: x.argmax(dim=-1))
            ours = per_call(lambda x=x: greedy(x))
            print(f"{rows} rows x {args.vocab}: torch {theirs * 1e6:.0f} us, compiled "
                  f"{ours * 1e6:.0f} us ({theirs / ours:.1f}x)", flush=True)


def after_head(threads: int, vocab: int, hidden: int = 896, calls: int = 40) -> None:
    from tokenmill.layers import huge_pages, native_linear
    from tokenmill.layers.native import native_row_ops

    if not native_linear.available() or native_row_ops() is None:
        raise SystemExit("needs the native kernel and row operators")
    with huge_pages.for_weights(True):
        head = native_linear.pack(torch.randn(vocab, hidden) * 0.02)
    x, ops = torch.randn(1, hidden), native_row_ops()
    counts = sorted({1, threads})
    cold: dict[int, list[float]] = {n: [] for n in counts}
    warm: dict[int, list[float]] = {n: [] for n in counts}
    with torch.inference_mode():
        for _ in range(calls):  # the thread counts in turn, after a head each
            for n in counts:
                torch.set_num_threads(threads)
                logits = native_linear.linear(x, head, None, vocab)
                torch.set_num_threads(n)
                started = time.perf_counter()
                ops.argmax(logits)
                cold[n].append(time.perf_counter() - started)
                started = time.perf_counter()
                ops.argmax(logits)
                warm[n].append(time.perf_counter() - started)
    torch.set_num_threads(threads)
    for n in counts:
        print(f"argmax on {n} thread(s), after the head: median "
              f"{statistics.median(cold[n]) * 1e6:.0f} us (quartiles "
              f"{statistics.quantiles(cold[n])[0] * 1e6:.0f}-"
              f"{statistics.quantiles(cold[n])[2] * 1e6:.0f}), again: "
              f"{statistics.median(warm[n]) * 1e6:.0f} us", flush=True)


if __name__ == "__main__":
    main()
