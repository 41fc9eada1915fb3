"""One-row decode steps of engine variants in one process, requests alternated.

A VM's speed drifts by 10% over minutes, so an A/B across processes run one after the
other measures the drift as much as the change. Here every variant runs in the same
process and the variants take turns request by request (--rounds of them, each
--prompt random tokens + --new-tokens greedy tokens, one at a time), each decode step
split as bench_step_overhead.py splits it: the compiled decoder stack, the LM head and
the rest. Reports the medians per variant.

Variants are either engines built with different settings (--engines, NAME=JSON of
EngineConfig keyword arguments; two engines hold two copies of the weights), or one
engine on the native kernel with the fetch distance of its few-row tiles switched
between requests (--stream-ahead, columns; layers/fetch_distance.py):

    python benchmarks/bench_step_ab.py --engines 'arena={"weight_arena": true}' \\
        'apart={"weight_arena": false}'
    python benchmarks/bench_step_ab.py --stream-ahead 64 48 32 16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from bench_step_overhead import DEFAULT_MODEL, Timed, TimedKernel

from tokenmill import SamplingParams
from tokenmill.bench.ceilings import host_description
from tokenmill.engine.engine import LLMEngine
from tokenmill.layers import native_linear


class Variant:
    """An engine with its stack and LM head timed, and what to set before its turn."""

    timers: dict[int, tuple[TimedKernel, Timed]] = {}  # per engine: variants share one

    def __init__(self, engine: LLMEngine, before=None) -> None:
        model = engine.executor.worker.runner.model
        if model.decode_stack is None:
            raise SystemExit("this model or host takes no compiled decode stack")
        self.engine, self.before = engine, before
        if id(engine) not in Variant.timers:
            stack = model.decode_stack.kernel = TimedKernel(model.decode_stack.kernel)
            Variant.timers[id(engine)] = (stack, Timed(model, "compute_logits"))
        self.stack, self.head = Variant.timers[id(engine)]
        self.steps: list[tuple[float, float, float]] = []

    def request(self, name: str, prompt: list[int], new_tokens: int) -> None:
        if self.before is not None:
            self.before()
        self.engine.add_request(name, prompt, SamplingParams(
            max_tokens=new_tokens, temperature=0, ignore_eos=True))
        while self.engine.has_unfinished_requests():
            self.stack.spent = self.head.spent = 0.0
            started = time.perf_counter()
            self.engine.step()
            if self.stack.spent:  # a decode step (the prefill takes the layers' path)
                self.steps.append((time.perf_counter() - started, self.stack.spent,
                                   self.head.spent))

    def summary(self) -> str:
        step, stack, head = (statistics.median(c) * 1e3 for c in zip(*self.steps, strict=True))
        rest = statistics.median(t - s - h for t, s, h in self.steps) * 1e3
        return (f"step {step:.2f} = stack {stack:.2f} + head {head:.2f} + rest {rest:.3f} ms"
                f" ({len(self.steps)} steps)")


def engine(model: str, max_model_len: int, **settings) -> LLMEngine:
    settings.setdefault("cpu_blas", "native")
    return LLMEngine.from_kwargs(model, progress=False, max_model_len=max_model_len,
                                 **settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=96)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--engines", nargs="+", metavar="NAME=JSON")
    which.add_argument("--stream-ahead", nargs="+", type=int, metavar="COLUMNS")
    args = parser.parse_args()
    print(host_description())
    length = args.prompt + args.new_tokens + 16
    variants: dict[str, Variant] = {}
    if args.engines:
        for spec in args.engines:
            name, _, settings = spec.partition("=")
            variants[name] = Variant(engine(args.model, length, **json.loads(settings or "{}")))
    else:
        shared = engine(args.model, length)
        for columns in args.stream_ahead:
            variants[f"stream ahead {columns}"] = Variant(
                shared, lambda c=columns: native_linear.set_stream_ahead(c))
    rng = random.Random(0)
    vocab = next(iter(variants.values())).engine.arch.vocab_size
    for round_ in range(args.rounds):
        for name, variant in variants.items():
            prompt = [rng.randrange(10, vocab - 1) for _ in range(args.prompt)]
            variant.request(f"{name}-{round_}", prompt, args.new_tokens)
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print("variant: median per decode step")
    for name, variant in variants.items():
        print(f"{name}: {variant.summary()}")


if __name__ == "__main__":
    main()
