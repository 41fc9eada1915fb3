"""Where a decode step's time goes: the float32 products vs everything else.

--batch requests (default one) of --prompt random tokens + --new-tokens greedy tokens
each, all submitted together, on the random Qwen2.5-0.5B shape (or --model), under
--cpu-blas. Each round reports the time per output token of a request (TPOT: with
every request in flight, one decode step), the time inside the product kernel per
decode step (every Linear's call on decode rows timed; the LM head apart), and then,
with the products replaced by zeros of the right shape, the TPOT that is left: the
engine's own work per step (attention, norms, rotary, sampling, scheduling, Python).
--flush adds a third run: zeros again, but each product first reads a buffer as large
as its weight (timed apart), so the rest of the step runs after the caches were
flushed as real products flush them; its TPOT less those reads is the engine's work
with cold caches.

    python benchmarks/bench_decode_split.py [--cpu-blas native] [--batch 1] [--rounds 3]
        [--flush]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import add_decode_arguments, decode_setup  # noqa: E402

from tokenmill.layers.linear import Linear  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_arguments(parser, rounds=3)
    parser.add_argument("--flush", action="store_true")
    args = parser.parse_args()
    llm, prompts, params = decode_setup(args)
    llm.generate(prompts, params)  # warm-up

    spent = {"products": 0.0, "head": 0.0}
    real_forward = Linear.forward

    def timed(layer: Linear, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        started = time.perf_counter()
        out = real_forward(layer, x, silu_mul=silu_mul)
        elapsed = time.perf_counter() - started
        if x.numel() <= x.shape[-1] * args.batch:  # decode rows (prompts are longer)
            spent["products"] += elapsed
            if layer.out_features == vocab:
                spent["head"] += elapsed
        return out

    def zeros(layer: Linear, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        # A gate/up layer called with its activation returns half its outputs.
        return x.new_zeros(*x.shape[:-1], layer.out_features // (2 if silu_mul else 1))

    buffers: dict[int, torch.Tensor] = {}
    read = [0.0]

    def flushed(layer: Linear, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        if id(layer) not in buffers:
            buffers[id(layer)] = torch.ones(layer.out_features, layer.in_features)
        buffer = buffers[id(layer)]
        started = time.perf_counter()
        buffer.sum()
        read[0] += time.perf_counter() - started
        return zeros(layer, x, silu_mul)

    vocab = llm.engine.executor.worker.runner.model.lm_head.out_features
    tokens = args.new_tokens - 1  # TPOT counts the tokens after the first
    print(f"{args.cpu_blas}, {args.batch} x (prompt {args.prompt} + {args.new_tokens} new), "
          f"{args.threads} threads")

    def step_time() -> float:
        outputs = llm.generate(prompts, params)
        return sum(o.outputs[0].metrics.time_per_output_token for o in outputs) / len(outputs)

    for round_ in range(args.rounds):
        spent.update(products=0.0, head=0.0)
        Linear.forward = timed
        tpot = step_time()
        Linear.forward = zeros
        rest = step_time()
        cold = ""
        if args.flush:
            read[0] = 0.0
            Linear.forward = flushed
            flushed_tpot = step_time()
            cold = (f"; flushed: TPOT {flushed_tpot * 1e3:.1f}, reads {read[0] / tokens * 1e3:.1f}, "
                    f"rest {(flushed_tpot - read[0] / tokens) * 1e3:.2f} ms")
        Linear.forward = real_forward
        print(f"round {round_ + 1}: TPOT {tpot * 1e3:.1f} ms, products "
              f"{spent['products'] / tokens * 1e3:.1f} ms/step (LM head "
              f"{spent['head'] / tokens * 1e3:.1f}), products zeroed: TPOT {rest * 1e3:.2f} ms"
              + cold)


if __name__ == "__main__":
    main()
