"""A decode step taken whole, in one engine, interleaved rounds, three ways:

    stack          the compiled decoder stack: every layer's kernels called from one
                   C++ loop (model/decode_stack.py)
    whole attn     the layers' Python path, each layer's attention taken whole from its
                   qkv projection (one compiled call: rotation, K/V write, attention)
    layer's steps  the layers' Python path with the layer's own attention steps (split,
                   views, rotation, then the write-and-attend call)

--batch requests of --prompt random tokens + --new-tokens greedy tokens each on the
random Qwen2.5-0.5B shape (or --model), float32, `paged-native` attention. The stack is
switched off by unsetting the model's stack, the whole attention by the backend
declining every step (as a backend that does not take it does). The tokens must be
identical. Reports the time per output token (TPOT: one decode step with every request
in flight) of each way, its median and the ratios to the first way.

    python benchmarks/bench_whole_decode.py [--batch 1] [--rounds 5] [--cpu-blas native]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import add_decode_arguments, decode_setup  # noqa: E402

from tokenmill.attention.paged_native import PagedNativeAttention  # noqa: E402
from tokenmill.bench.ceilings import host_description  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_arguments(parser, rounds=5)
    args = parser.parse_args()
    llm, prompts, params = decode_setup(args, attention_backend="paged-native")
    model = llm.engine.executor.worker.runner.model
    stack, whole = model.decode_stack, PagedNativeAttention.takes_whole_decode
    if stack is None:
        raise SystemExit("the decode stack does not take this model and --cpu-blas")
    declined = lambda self, metadata: False  # noqa: E731
    ways = {"stack": (stack, whole), "fresh tensors": (stack, whole),
            "whole attn": (None, whole), "layer's steps": (None, declined)}
    tpot: dict[str, list[float]] = {way: [] for way in ways}
    expected = None
    print(f"{host_description()}; {args.cpu_blas}, {args.batch} x (prompt {args.prompt} + "
          f"{args.new_tokens} new), {args.threads} threads")
    try:
        for round_ in range(args.rounds + 1):  # the first round warms up
            for way, (model.decode_stack, method) in ways.items():
                PagedNativeAttention.takes_whole_decode = method
                stack.kernel.fresh = way == "fresh tensors"
                outputs = llm.generate(prompts, params)
                tokens = [o.outputs[0].token_ids for o in outputs]
                expected = expected or tokens
                if tokens != expected:
                    raise SystemExit(f"{way}: tokens differ from the first way's")
                if round_:
                    tpot[way].append(1e3 * statistics.fmean(
                        o.outputs[0].metrics.time_per_output_token for o in outputs))
    finally:
        model.decode_stack, PagedNativeAttention.takes_whole_decode = stack, whole
        stack.kernel.fresh = False
    medians = {way: statistics.median(times) for way, times in tpot.items()}
    for way, times in tpot.items():
        print(f"  {way:14s} TPOT median {medians[way]:7.2f} ms  (rounds "
              + ", ".join(f"{t:.2f}" for t in times) + ")")
    for way in list(ways)[1:]:
        print(f"  {way} / stack: {medians[way] / medians['stack']:.3f}x")

if __name__ == "__main__":
    main()
