"""Where a single-stream decode token's time goes: the float32 products vs everything else.

One request of --prompt random tokens + --new-tokens greedy tokens on the random
Qwen2.5-0.5B shape (or --model), under --cpu-blas. Each round reports the time per
output token (TPOT), the time inside the product kernel per token (every Linear's
call timed; the LM head apart), and then, with the products replaced by zeros of the
right shape, the TPOT that is left: the engine's own work per token (attention, norms,
rotary, sampling, scheduling, Python).

    python benchmarks/bench_decode_split.py [--cpu-blas native] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import MODEL_DIR, build_model  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.layers.linear import Linear  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--cpu-blas", default="native")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = args.model or str(build_model(MODEL_DIR))
    llm = LLM(model, progress=False, num_threads=args.threads, kv_cache_memory=2**28,
              cpu_blas=args.cpu_blas)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 100000) for _ in range(args.prompt)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up

    spent = {"products": 0.0, "head": 0.0}
    real_forward = Linear.forward

    def timed(layer: Linear, x: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        out = real_forward(layer, x)
        elapsed = time.perf_counter() - started
        if x.numel() == x.shape[-1]:  # one row: a decode token's product
            spent["products"] += elapsed
            if layer.out_features == vocab:
                spent["head"] += elapsed
        return out

    def zeros(layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], layer.out_features)

    vocab = llm.engine.executor.worker.runner.model.lm_head.out_features
    tokens = args.new_tokens - 1  # TPOT counts the tokens after the first
    print(f"{args.cpu_blas}, prompt {args.prompt} + {args.new_tokens} new, {args.threads} threads")
    for round_ in range(args.rounds):
        spent.update(products=0.0, head=0.0)
        Linear.forward = timed
        tpot = llm.generate([prompt], params)[0].outputs[0].metrics.time_per_output_token
        Linear.forward = zeros
        rest = llm.generate([prompt], params)[0].outputs[0].metrics.time_per_output_token
        Linear.forward = real_forward
        print(f"round {round_ + 1}: TPOT {tpot * 1e3:.1f} ms, products "
              f"{spent['products'] / tokens * 1e3:.1f} ms/token (LM head "
              f"{spent['head'] / tokens * 1e3:.1f}), products zeroed: TPOT {rest * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
