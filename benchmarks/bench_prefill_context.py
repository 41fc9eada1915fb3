"""Prefill chunks with a cached context: attention split in two fused calls (context,
then the chunk causally, merged by log-sum-exp) against one SDPA call under a mask.

Per layer: a chunk of n queries over its context at each --shapes "n:context", on the
--heads / --kv-heads / --head-dim shape (the 0.5B shape's by default), the two forms
alternated, best of --rounds; GFLOP/s counts the scores and the weighted sums a causal
chunk needs (4 x n x (context + n / 2) x heads x head_dim). With --engine, also the
whole prefill of one --prompt-token random prompt in chunks of --budget tokens on the
random Qwen2.5-0.5B shape (or --model), each form in turn, --rounds times.

    python benchmarks/bench_prefill_context.py [--shapes 512:2048 2048:6144]
        [--engine --prompt 8192 --budget 2048]
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import MODEL_DIR, build_model  # noqa: E402

import tokenmill.attention.paged as paged  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.ceilings import machine_ceilings  # noqa: E402
from tokenmill.layers.timing import best_seconds  # noqa: E402

FORMS = {"split": True, "mask": False}


def per_layer(args: argparse.Namespace) -> None:
    print("n     context | split ms (GFLOP/s) | mask ms (GFLOP/s) | mask / split")
    generator = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        n, context = map(int, shape.split(":"))
        q = torch.randn(1, args.heads, n, args.head_dim, generator=generator)
        # Strided as the cache's gather gives them.
        keys, values = (torch.randn(context + n, args.kv_heads, args.head_dim,
                                    generator=generator).transpose(0, 1)[None]
                        for _ in range(2))
        flops = 4 * n * (context + n / 2) * args.heads * args.head_dim
        times = {name: float("inf") for name in FORMS}
        for _ in range(2):  # alternate the forms
            for name, split in FORMS.items():
                call = functools.partial(paged.context_attention, q, keys, values, context,
                                         0.125, split=split)
                times[name] = min(times[name], best_seconds(call, args.rounds))
        split, mask = times["split"], times["mask"]
        print(f"{n:<5} {context:<7} | {split * 1e3:8.1f} ({flops / split / 1e9:4.0f})    | "
              f"{mask * 1e3:8.1f} ({flops / mask / 1e9:4.0f})   | {mask / split:.2f}x", flush=True)


def engine(args: argparse.Namespace) -> None:
    model = args.model or str(build_model(MODEL_DIR))
    llm = LLM(model, progress=False, num_threads=args.threads, enable_prefix_caching=False,
              max_num_batched_tokens=args.budget, enable_chunked_prefill=True,
              max_model_len=args.prompt + 16)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 100000) for _ in range(args.prompt)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt[:args.budget + 64]], params)  # warm-up, one chunk with a context
    real = paged.context_attention
    tokens = {}
    for round_ in range(args.rounds):
        for name, split in FORMS.items():
            paged.context_attention = functools.partial(real, split=split)
            started = time.perf_counter()
            out = llm.generate([prompt], params)
            seconds = time.perf_counter() - started
            tokens.setdefault(name, out[0].outputs[0].token_ids)
            print(f"round {round_ + 1} {name:<5}: prefill of {args.prompt} tokens in chunks of "
                  f"{args.budget}: {seconds:6.1f} s ({args.prompt / seconds:5.0f} tok/s)",
                  flush=True)
    paged.context_attention = real
    print("first token, split vs mask:", "same" if tokens["split"] == tokens["mask"]
          else "DIFFERENT")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=[
        "128:1024", "512:2048", "2048:2048", "512:8192", "2048:6144", "2048:14336"])
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ceilings = machine_ceilings(args.threads)
    print(f"torch {torch.__version__}; {ceilings.machine}, {args.threads} threads; ceilings "
          f"{ceilings.matmul_gflops:.1f} GFLOP/s fp32 GEMM, {ceilings.bandwidth_gbs:.1f} GB/s")
    per_layer(args)
    if args.engine:
        engine(args)


if __name__ == "__main__":
    main()
