"""The native float32 kernel against oneDNN per layer shape and row count (GFLOP/s).

The Qwen2.5-0.5B shape's gate/up, down and QKV products at each --rows count, best of
several calls each, both libraries on the same random weights. --panels builds the
native kernel once per row-panel size (the kernel's TM_PANEL; a size above the rows
means no panels) and reports each beside oneDNN; --builds takes any other compile-time
settings, one build per argument (e.g. "TM_CHUNK=128 TM_PANEL=64").

    python benchmarks/bench_native_rows.py [--rows 256,2048] [--panels 128,100000]
    python benchmarks/bench_native_rows.py --builds TM_CHUNK=256 TM_CHUNK=128
    python benchmarks/bench_native_rows.py --rows 1,8 --copies 8    # weights from memory
"""

from __future__ import annotations

import argparse
import functools

import torch

from tokenmill.layers import cpu_blas, native_linear
from tokenmill.layers.native import build_extension
from tokenmill.layers.timing import best_seconds

SHAPES = ((9728, 896), (896, 4864), (1152, 896))  # (out, in): gate/up, down, QKV


def best_rate(fn, flops: float) -> float:
    return flops / best_seconds(fn, max(6, int(4e10 / flops))) / 1e9


def in_turn(kernel, x, weights, *rest) -> None:
    for weight in weights:
        kernel(x, weight, *rest)


def onednn_call(x, weight, _unused) -> None:
    cpu_blas.onednn_linear(x, weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,256,2048")
    parser.add_argument("--panels", default="256", help="native builds by TM_PANEL")
    parser.add_argument("--builds", nargs="+", metavar="MACRO=VALUE ...",
                        help="native builds by their -D settings (replaces --panels)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--copies", type=int, default=1,
                        help="weights per shape, called in turn (8: beyond the caches, "
                             "as a decode step reads them)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    builds = args.builds or [f"TM_PANEL={int(panel)}" for panel in args.panels.split(",")]
    kernels = {build: build_extension("f32_linear", native_linear.SOURCE,
                                      (*native_linear.FLAGS,
                                       *(f"-D{define}" for define in build.split())))
               for build in builds}
    print("out x in, rows: " + ", ".join(f"native {b}" for b in kernels)
          + ", oneDNN (GFLOP/s)")
    for out_features, in_features in SHAPES:
        weights = [torch.randn(out_features, in_features) for _ in range(args.copies)]
        packed = [native_linear.pack(weight) for weight in weights]
        onednn = ([cpu_blas.onednn_weight(weight, False) for weight in weights]
                  if cpu_blas.onednn_available() else None)
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, in_features)
            flops = 2.0 * rows * out_features * in_features * args.copies
            calls = [functools.partial(in_turn, k.f32_linear, x, packed, None, out_features)
                     for k in kernels.values()]
            if onednn is not None:
                calls.append(functools.partial(in_turn, onednn_call, x, onednn, None))
            rates = [best_rate(call, flops) for call in calls]
            print(f"{out_features} x {in_features}, {rows}: "
                  + ", ".join(f"{r:.1f}" for r in rates), flush=True)


if __name__ == "__main__":
    main()
