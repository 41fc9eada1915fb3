"""The gated MLP's gate/up product with its activation fused into the native kernel,
against the product then silu_mul (two calls), per row count.

The Qwen2.5-0.5B shape's gate/up layer (9728 x 896) on random weights. Each round times
the two forms in turn, best of several calls each (--copies weights called in turn: 8
reads them from memory, as a decode step does); the table is the best per form over
--rounds rounds, with the ratio. Also checks the two agree bit for bit.

    python benchmarks/bench_fused_mlp.py
    python benchmarks/bench_fused_mlp.py --rows 1,8 --copies 8
    env $(python -m tokenmill.layers.isa avx2) python benchmarks/bench_fused_mlp.py
"""

from __future__ import annotations

import argparse
import functools
import platform

import torch

from tokenmill.layers import native_linear
from tokenmill.layers.isa import capped_isa
from tokenmill.layers.native import native_row_ops
from tokenmill.layers.timing import best_seconds

HIDDEN, INTERMEDIATE = 896, 4864


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,256,2048")
    parser.add_argument("--copies", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not native_linear.available():
        raise SystemExit("the native kernel cannot be built here (no C++ compiler)")
    ops, kernel = native_row_ops(), native_linear.library()
    out_features = 2 * INTERMEDIATE
    packed = [native_linear.pack(torch.randn(out_features, HIDDEN) * 0.05)
              for _ in range(args.copies)]

    def two_calls(x):
        for weight in packed:
            ops.silu_mul(kernel.f32_linear(x, weight, None, out_features))

    def fused(x):
        for weight in packed:
            kernel.f32_linear_silu_mul(x, weight, None, out_features)

    print(f"host: {platform.processor() or platform.machine()}, {args.threads} threads, "
          f"ISA {capped_isa() or 'native'}; gate/up {out_features} x {HIDDEN}, "
          f"{args.copies} weight copies")
    print(f"{'rows':>6} {'two calls ms':>13} {'fused ms':>9} {'GFLOP/s':>15} {'speed-up':>9}")
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, HIDDEN)
        assert torch.equal(kernel.f32_linear_silu_mul(x, packed[0], None, out_features),
                           ops.silu_mul(kernel.f32_linear(x, packed[0], None, out_features)))
        repeats = max(5, int(2e10 / (2.0 * rows * HIDDEN * out_features * args.copies)))
        best = [float("inf"), float("inf")]
        for _ in range(args.rounds):
            for i, form in enumerate((two_calls, fused)):
                best[i] = min(best[i], best_seconds(functools.partial(form, x), repeats))
        flops = 2.0 * rows * HIDDEN * out_features * args.copies
        print(f"{rows:6d} {best[0] * 1e3:13.3f} {best[1] * 1e3:9.3f} "
              f"{flops / best[0] / 1e9:7.1f} {flops / best[1] / 1e9:7.1f} "
              f"{best[0] / best[1]:8.3f}x", flush=True)


if __name__ == "__main__":
    main()
