"""Where a prefill's (or a whole generation's) time goes: each product, the attention, the
work between them, and the engine around the model, against this host's fp32 GEMM
ceiling.

--requests random prompts of --prompt tokens (prefix caching off) are prefilled (one
output token; --new-tokens N: generated in full) under each configuration after a
warm-up, --rounds times. Forward hooks on
every module of the model time it exclusive of the modules inside it, so each row of
the table is its own work (with hooks on the layers, decode steps run the layers' Python
path, not the compiled decode stack, model/decode_stack.py: the table is that path's):

    qkv_proj, o_proj, gate_up_proj, down_proj, lm_head   the products (GFLOP/s: 2 x rows
                                                          x in x out over their time)
    gate_up_proj             includes the MLP's activation, silu(gate) * up: the layer
                             computes both in one call (fused into the native kernel)
    attention                Attention.forward less its products: split, rope, q/k
                             norms, the KV cache write and the attention itself
    mlp, other               GatedMLP less its products (the row slicing)
    norms, residual          the layers' RMSNorms and residual adds (DecoderLayer less
                             its attention and MLP)
    model, other             embedding, rope tables, the final norm, the rows to score
    engine                   everything outside the model's forward: scheduling, input
                             preparation, sampling, detokenising, outputs

    python benchmarks/bench_breakdown.py --configs "native:cpu_blas=native" \\
        "onednn:cpu_blas=onednn"
    python benchmarks/bench_breakdown.py --requests 1 --new-tokens 64 \\
        --configs "int8:quantization=int8"      # single-stream decode
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prefill import decoder_weights, engines, prepare  # noqa: E402

from tokenmill import SamplingParams  # noqa: E402
from tokenmill.layers.linear import Linear  # noqa: E402

PRODUCTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
EXCLUSIVE = {"Attention": "attention", "GatedMLP": "mlp, other",
             "RMSNorm": "norms, residual", "DecoderLayer": "norms, residual"}


def category(name: str, module) -> str:
    if isinstance(module, Linear):
        return name.rsplit(".", 1)[-1] if name.rsplit(".", 1)[-1] in PRODUCTS else "other products"
    return EXCLUSIVE.get(type(module).__name__, "model, other")


class ExclusiveTimer:
    """Seconds per category, each module's time less the modules it called; FLOPs of the
    products."""

    def __init__(self, model) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.flops: dict[str, float] = collections.defaultdict(float)
        self.model_seconds = 0.0
        self.enabled = False
        self._stack: list[list] = []  # [category, start, seconds spent in children]
        self._handles = []
        for name, module in model.named_modules():
            kind = category(name, module)
            self._handles.append(module.register_forward_pre_hook(self._enter(kind)))
            self._handles.append(module.register_forward_hook(
                self._leave(module if isinstance(module, Linear) else None)))

    def _enter(self, kind: str):
        def hook(module, args):
            if self.enabled:
                self._stack.append([kind, time.perf_counter(), 0.0])
        return hook

    def _leave(self, linear):
        def hook(module, args, output):
            if not self.enabled or not self._stack:
                return
            kind, started, children = self._stack.pop()
            spent = time.perf_counter() - started
            self.seconds[kind] += spent - children
            if self._stack:
                self._stack[-1][2] += spent
            else:
                self.model_seconds += spent
            if linear is not None:
                x = args[0]
                rows = x.numel() // x.shape[-1]
                self.flops[kind] += 2.0 * rows * linear.in_features * linear.out_features
        return hook

    def reset(self) -> None:
        self.seconds.clear()
        self.flops.clear()
        self.model_seconds = 0.0


def print_table(timer: ExclusiveTimer, wall: float, ceiling: float) -> None:
    rows = sorted(timer.seconds.items(), key=lambda item: -item[1])
    rows.append(("engine", wall - timer.model_seconds))
    print(f"  {'part':<16} {'s':>7} {'share':>6} {'GFLOP/s':>8} {'of ceiling':>10}")
    for kind, seconds in rows:
        rate = timer.flops.get(kind, 0.0) / seconds / 1e9 if seconds > 0 else 0.0
        rate_text = f"{rate:8.1f} {rate / ceiling:10.2f}" if kind in timer.flops else ""
        print(f"  {kind:<16} {seconds:7.2f} {seconds / wall:6.1%} {rate_text}")
    products = sum(timer.flops.values())
    print(f"  {'whole':<16} {wall:7.2f} {1:6.0%} {products / wall / 1e9:8.1f} "
          f"{products / wall / 1e9 / ceiling:10.2f}  (every product's FLOPs over the wall)")


def main() -> None:
    args, model, ceilings, prompts = prepare(__doc__.splitlines()[0], new_tokens=1)
    for name, llm in engines(args, model, prompts):
        runner = llm.engine.executor.worker.runner
        flops_per_token = 2 * decoder_weights(runner.arch)
        timer = ExclusiveTimer(runner.model)
        for round_ in range(args.rounds):
            timer.reset()
            timer.enabled = True
            started = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.new_tokens,
                                                 ignore_eos=True))
            wall = time.perf_counter() - started
            timer.enabled = False
            tokens = args.requests * (args.prompt + args.new_tokens - 1)
            decoder = tokens * flops_per_token / wall / 1e9
            print(f"{name} round {round_ + 1}: {args.requests} x ({args.prompt} + "
                  f"{args.new_tokens}) in {wall:.2f} s, decoder products "
                  f"{decoder:.1f} GFLOP/s ({decoder / ceilings.matmul_gflops:.2f} of the "
                  f"ceiling, as bench_prefill.py counts)")
            print_table(timer, wall, ceilings.matmul_gflops)
        del llm, runner, timer  # before the next engine is built (see engines)

if __name__ == "__main__":
    main()
