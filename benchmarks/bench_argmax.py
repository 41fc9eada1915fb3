"""Greedy sampling's argmax over a 151936-token vocabulary (the Qwen2.5 shape): torch's
argmax against the compiled row operator the sampler takes on the CPU
(layers/sampler.py `greedy`, layers/csrc/row_ops.cpp), best of 5 x 50 calls, in
inference mode as the engine runs it.

    python benchmarks/bench_argmax.py [--threads 2] [--rows 1 8 32]
"""

from __future__ import annotations

import argparse

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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(rows, args.vocab, generator=generator)
            assert torch.equal(greedy(x), x.argmax(dim=-1))
            theirs = per_call(lambda x=x: x.argmax(dim=-1))
            ours = per_call(lambda x=x: greedy(x))
            print(f"{rows} rows x {args.vocab}: torch {theirs * 1e6:.0f} us, compiled "
                  f"{ours * 1e6:.0f} us ({theirs / ours:.1f}x)", flush=True)


if __name__ == "__main__":
    main()
