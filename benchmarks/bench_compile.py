"""Would a compiled decode step pay here? torch.compile of the model's decode forward
against the engine's eager one, in the same process, same requests.

The engine's eager decode step is already mostly compiled code: the products are one
kernel call each (native, oneDNN), norms, residual adds, SiLU x up and rotary are
tokenmill's own row kernels, decode attention one kernel per layer. What a compiler
could still remove is the Python between those calls. This script measures that
before the engine grows a `--compile` switch: it makes the products and attention
opaque custom ops (the KV write stays inside attention), lets the row operations
fall back to their torch forms for inductor to fuse (its C++ CPU backend), compiles
the model's forward for decode-only steps (one static graph for one row, one dynamic
for more), and alternates eager and compiled rounds. --zero-products replaces every
product by zeros of the right shape in both, which isolates the rest of the step.

    python benchmarks/bench_compile.py [--cpu-blas native] [--batch 1 32] [--zero-products]
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

import tokenmill.layers.activation  # noqa: E402
import tokenmill.layers.norm  # noqa: E402
import tokenmill.layers.rotary  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.layers import native  # noqa: E402
from tokenmill.layers.linear import Linear  # noqa: E402

LAYERS: list[Linear] = []
CURRENT: list = [None]  # the step's AttentionContext, read inside the attention op
PRODUCT = [Linear.forward]


@torch.library.custom_op("tokenmill_bench::linear", mutates_args=())
def linear_op(x: torch.Tensor, layer: int, out_features: int) -> torch.Tensor:
    return PRODUCT[0](LAYERS[layer], x)


@linear_op.register_fake
def _(x, layer, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("tokenmill_bench::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 scale: float) -> torch.Tensor:
    return CURRENT[0](layer, q, k, v, scale)


@attention_op.register_fake
def _(q, k, v, layer, scale):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


class OpaqueAttention:
    def __call__(self, layer, q, k, v, scale):
        return attention_op(q, k, v, layer, scale)


def patch_for_tracing() -> None:
    """Under dynamo: products through the op, row operations in their torch forms."""
    def forward(layer: Linear, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        if torch.compiler.is_compiling():
            out = linear_op(x, layer.bench_id, layer.out_features)
            return tokenmill.layers.activation.silu_and_mul(out) if silu_mul else out
        return PRODUCT[0](layer, x, silu_mul=silu_mul)

    eager_row_ops = native.row_ops_for

    def row_ops_for(*tensors):
        return None if torch.compiler.is_compiling() else eager_row_ops(*tensors)

    Linear.forward = forward
    for module in (tokenmill.layers.norm, tokenmill.layers.activation, tokenmill.layers.rotary):
        module.row_ops_for = row_ops_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--cpu-blas", default="native")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--zero-products", action="store_true")
    args = parser.parse_args()
    if args.zero_products:
        PRODUCT[0] = lambda layer, x: x.new_zeros(*x.shape[:-1], layer.out_features)
    patch_for_tracing()
    llm = LLM(args.model or str(build_model(MODEL_DIR)), progress=False,
              num_threads=args.threads, kv_cache_memory=2**28, cpu_blas=args.cpu_blas)
    runner = llm.engine.executor.worker.runner
    model = runner.model
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.bench_id = len(LAYERS)
            LAYERS.append(layer)
    compiled = torch.compile(lambda ids, pos: model(ids, pos, OpaqueAttention()))
    eager_forward = runner.forward
    use_compiled = [False]

    def forward(batch, hidden=None):
        decode_only = (hidden is None and len(batch.token_ids) == len(batch.order)
                       == batch.layout.num_decode_requests)
        if use_compiled[0] and decode_only:
            CURRENT[0] = batch.attention
            return compiled(batch.token_ids, batch.positions)
        return eager_forward(batch, hidden)

    runner.forward = forward
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    print(f"{args.cpu_blas}{', products zeroed' if args.zero_products else ''}, "
          f"prompt {args.prompt} + {args.new_tokens} new, {args.threads} threads")
    for batch in args.batch:
        prompts = [[rng.randrange(1000, 100000) for _ in range(args.prompt)]
                   for _ in range(batch)]

        def run(compiled_: bool, prompts=prompts):
            use_compiled[0] = compiled_
            outputs = llm.generate(prompts, params)
            tpot = sum(o.outputs[0].metrics.time_per_output_token for o in outputs)
            return [o.outputs[0].token_ids for o in outputs], tpot / len(outputs) * 1e3

        eager_tokens, _ = run(False)
        started = time.perf_counter()
        compiled_tokens, _ = run(True)  # compiles (a cache on disk makes later runs quick)
        print(f"batch {batch}: first compiled run {time.perf_counter() - started:.1f} s; "
              f"same greedy tokens as eager: {compiled_tokens == eager_tokens}")
        for round_ in range(args.rounds):
            eager, fused = run(False)[1], run(True)[1]
            print(f"  round {round_ + 1}: TPOT eager {eager:.2f} ms, compiled {fused:.2f} ms "
                  f"(eager / compiled {eager / fused:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
