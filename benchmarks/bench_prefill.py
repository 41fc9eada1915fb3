"""Prefill rate per engine configuration, against this host's fp32 GEMM ceiling.

--requests random prompts of --prompt tokens each (prefix caching off) are prefilled
(one output token) and then generated in full (--new-tokens each) under each
configuration, one engine at a time, --rounds times. Printed per configuration and
round: prefill seconds, prompt tokens/s, the products' GFLOP/s (2 x a dense decoder's
weights per prompt token, the LM head and attention left out), its share of the host's
GEMM ceiling (`machine_ceilings`, measured again at the start of each run unless
--cached-ceilings), the page faults the prefill took (memory handed back and faulted in
again: layers/allocator.py), and the whole run's output tokens/s.

    python benchmarks/bench_prefill.py \\
        --configs "sliced:cpu_blas=native" "whole:cpu_blas=native,mlp_slice_rows=0"
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import MODEL_DIR, build_model  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.ceilings import describe, machine_ceilings  # noqa: E402
from tokenmill.model.loader import read_config  # noqa: E402


def parse_config(text: str) -> tuple[str, dict[str, object]]:
    """"name:key=value,key=value" -> (name, options); values as ints where they read so,
    true / false as booleans."""
    name, _, rest = text.partition(":")
    options: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if value.lower() in ("true", "false"):
            options[key] = value.lower() == "true"
        else:
            options[key] = int(value) if value.lstrip("-").isdigit() else value
    return name, options


def decoder_weights(arch) -> int:
    """Weights a prompt token multiplies in a dense decoder (the LM head apart)."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_layer = arch.hidden_size * (2 * q + 2 * kv) + 3 * arch.hidden_size * arch.intermediate_size
    return arch.num_layers * per_layer


def prepare(description: str, new_tokens: int
            ) -> tuple[argparse.Namespace, str, object, list[list[int]]]:
    """The command line this script and bench_breakdown.py share: (arguments, model
    directory, this host's ceilings (printed), the seeded random prompts)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=None)
    parser.add_argument("--configs", nargs="+", default=["native:cpu_blas=native"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cached-ceilings", action="store_true",
                        help="reuse the cached ceilings instead of measuring them in this run "
                             "(a VM's rates move between sessions under one machine name)")
    args = parser.parse_args()
    model = args.model or str(build_model(MODEL_DIR))
    ceilings = machine_ceilings(args.threads, refresh=not args.cached_ceilings)
    print(f"ceilings: {describe(ceilings)}, {ceilings.machine}")
    rng = random.Random(0)
    vocab = min(100000, read_config(model).vocab_size)  # pycoder's is 8192
    prompts = [[rng.randrange(vocab // 100, vocab) for _ in range(args.prompt)]
               for _ in range(args.requests)]
    return args, model, ceilings, prompts


def engines(args: argparse.Namespace, model: str,
            prompts: list[list[int]]) -> Iterator[tuple[str, LLM]]:
    """(name, engine) per --configs entry, prefix caching off, warmed up; one at a time
    when the caller drops its reference before asking for the next."""
    for text in args.configs:
        name, options = parse_config(text)
        llm = LLM(model, progress=False, num_threads=args.threads,
                  enable_prefix_caching=False, **options)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        yield name, llm
        del llm


def main() -> None:
    args, model, ceilings, prompts = prepare(__doc__.splitlines()[0], new_tokens=128)
    prompt_tokens = args.requests * args.prompt
    for name, llm in engines(args, model, prompts):
        flops_per_token = 2 * decoder_weights(llm.engine.executor.worker.runner.arch)
        for round_ in range(args.rounds):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            prefill = time.perf_counter() - started
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            started = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.new_tokens,
                                                 ignore_eos=True))
            whole = time.perf_counter() - started
            gflops = prompt_tokens * flops_per_token / prefill / 1e9
            print(f"{name:<12} round {round_ + 1}: prefill {prefill:6.1f} s "
                  f"{prompt_tokens / prefill:7.0f} tok/s {gflops:6.1f} GFLOP/s "
                  f"({gflops / ceilings.matmul_gflops:.2f} of the ceiling, {faults} page "
                  f"faults); whole "
                  f"{args.requests} x ({args.prompt} + {args.new_tokens}): "
                  f"{args.requests * args.new_tokens / whole:6.1f} out tok/s", flush=True)
        del llm  # before the next engine is built

if __name__ == "__main__":
    main()
