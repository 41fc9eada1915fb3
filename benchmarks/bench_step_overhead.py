"""A decode step's time outside its weight streams: the engine's own work per step.

One request at a time (--requests of them, each --prompt random tokens + --new-tokens
greedy tokens; --batch N submits N together: decode steps of N rows) on the random
Qwen2.5-0.5B shape (or --model), float32, the native kernel. Each decode step is timed
whole (`LLMEngine.step`), and within it the compiled decoder stack's call
(model/decode_stack.py) and the LM head (`compute_logits`); what is left is the engine's
Python and the small torch operations around them (scheduling,
inputs, metadata, embedding, sampling, detokenising, outputs), which run with the
caches cold after each step's 2 GB weight stream. Reports the medians per request.
--products also times, right after each decode step, one pass of the same model's
decoder products alone (its own packed weights, random rows of the step's count): the
stack less that pass is what the stack spends beyond its products (attention, norms,
and products slower inside the stack than alone). --ops times each of the stack's
operations in it (its `timed` switch: norms, qkv, attention, o, gate_up, down), and with
--products each product alone beside it.

    python benchmarks/bench_step_overhead.py [--requests 3] [--new-tokens 128]
    python benchmarks/bench_step_overhead.py --requests 2 --batch 32 --products
    python benchmarks/bench_step_overhead.py --requests 2 --batch 32 --products --ops
    python benchmarks/bench_step_overhead.py --no-weight-arena   # weights one by one

To compare revisions, run it from a worktree of each in turn (the kernels' builds are
cached by source, so a revision with the same C++ reuses them):

    git worktree add /tmp/base REV
    PYTHONPATH=/tmp/base python benchmarks/bench_step_overhead.py
    python benchmarks/bench_step_overhead.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

import tokenmill
from tokenmill import SamplingParams
from tokenmill.bench.ceilings import host_description
from tokenmill.engine.engine import LLMEngine
from tokenmill.layers import native_linear

DEFAULT_MODEL = Path.home() / ".cache" / "tokenmill" / "models" / "qwen2.5-0.5b-random"


class Timed:
    """Wraps obj.name, adding each call's seconds to `spent`."""

    def __init__(self, obj, name: str) -> None:
        self.call, self.spent = getattr(obj, name), 0.0
        setattr(obj, name, self)

    def __call__(self, *args):
        started = time.perf_counter()
        try:
            return self.call(*args)
        finally:
            self.spent += time.perf_counter() - started


class TimedKernel:
    """The stack's compiled object with its `run` timed (a pybind object: wrapped whole)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.spent = kernel, 0.0

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)

    def run(self, *args):
        started = time.perf_counter()
        try:
            return self.kernel.run(*args)
        finally:
            self.spent += time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1,
                        help="requests submitted together per round (decode rows per step)")
    parser.add_argument("--products", action="store_true",
                        help="after each decode step, time the model's products alone")
    parser.add_argument("--ops", action="store_true",
                        help="time each of the stack's operations (and each product alone)")
    parser.add_argument("--weight-arena", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine's weight arena (layers/weight_arena.py)")
    args = parser.parse_args()
    if args.batch < 1:
        parser.error(f"--batch must be 1 or more, got {args.batch}")
    print(host_description(), f"tokenmill from {Path(tokenmill.__file__).parent}", sep="\n")
    engine = LLMEngine.from_kwargs(args.model, progress=False, cpu_blas="native",
                                   weight_arena=args.weight_arena,
                                   max_model_len=args.prompt + args.new_tokens + 16)
    model = engine.executor.worker.runner.model
    if model.decode_stack is None:
        raise SystemExit("this model or host takes no compiled decode stack")
    stack = model.decode_stack.kernel = TimedKernel(model.decode_stack.kernel)
    stack.kernel.timed = args.ops
    head = Timed(model, "compute_logits")
    rng = random.Random(0)
    vocab = engine.arch.vocab_size
    alone = products_pass(model, args.batch) if args.products else None
    print("request: median ms per decode step: step = stack + LM head + the rest"
          + ("; the stack's products alone, stack - products" if alone else ""))
    for index in range(args.requests):
        for member in range(args.batch):
            engine.add_request(f"{index}-{member}",
                               [rng.randrange(10, vocab - 1) for _ in range(args.prompt)],
                               SamplingParams(max_tokens=args.new_tokens, temperature=0,
                                              ignore_eos=True))
        steps: list[tuple[float, float, float]] = []
        passes: list[float] = []
        ops: dict[str, list[float]] = {}
        while engine.has_unfinished_requests():
            stack.spent = head.spent = 0.0
            stack.kernel.spent(reset=True)
            started = time.perf_counter()
            engine.step()
            if stack.spent:  # a decode step (the prefill takes the layers' path)
                steps.append((time.perf_counter() - started, stack.spent, head.spent))
                for name, seconds in stack.kernel.spent(reset=True).items():
                    ops.setdefault(name, []).append(seconds)
                if alone:
                    seconds, by_kind = alone()
                    passes.append(seconds)
                    for name, spent in by_kind.items():
                        ops.setdefault(f"{name} alone", []).append(spent)
        step, kernel, logits = (statistics.median(column) * 1e3 for column in zip(*steps, strict=True))
        rest = statistics.median(total - s - h for total, s, h in steps) * 1e3
        line = f"{index}: {step:.2f} = {kernel:.2f} + {logits:.2f} + {rest:.3f}"
        if alone:
            beyond = statistics.median(s - p for (_, s, _), p in zip(steps, passes, strict=True))
            line += f"; {statistics.median(passes) * 1e3:.2f}, {beyond * 1e3:.2f}"
        print(line, flush=True)
        if args.ops:
            print("   ", ", ".join(f"{name} {statistics.median(spent) * 1e3:.2f}"
                                   for name, spent in ops.items()), flush=True)


def products_pass(model, rows: int):
    """A callable timing one pass of the model's decoder products at `rows` random rows,
    in the stack's order, with the kernel calls the stack makes: (seconds, seconds by
    product: qkv, o, gate_up, down)."""
    kernel = native_linear.library()
    products = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name, product in (("qkv", attn.qkv_proj), ("o", attn.o_proj),
                              ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):
            call = kernel.f32_linear_silu_mul if product is mlp.gate_up_proj else kernel.f32_linear
            products.append((name, call, product.native_weight, product.native_bias,
                             product.out_features, product.in_features))
    rows_by_width = {width: torch.randn(rows, width) for *_, width in products}

    def one_pass() -> tuple[float, dict[str, float]]:
        by_kind = dict.fromkeys(("qkv", "o", "gate_up", "down"), 0.0)
        started = mark = time.perf_counter()
        for name, call, weight, bias, out_features, width in products:
            call(rows_by_width[width], weight, bias, out_features)
            now = time.perf_counter()
            by_kind[name] += now - mark
            mark = now
        return mark - started, by_kind
    return one_pass


if __name__ == "__main__":
    main()
