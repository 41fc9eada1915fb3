"""One build of the native float32 kernel on one shape, weights cached, against torch's
product on the plain weight (MKL): the best GFLOP/s of --runs timed loops each.

    python benchmarks/bench_native_build_rate.py --rows 512 --threads 1
    python benchmarks/bench_native_build_rate.py --rows 512 --threads 1 \\
        --defines "TM_PREFETCH_NEXT=0 TM_STREAM_AHEAD=0"

--defines are the kernel's compile-time settings (layers/csrc/f32_tiles.h); each build
compiles once into its own cache directory. Decode tiles are off (the wide tile).
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill.layers import native_linear


def best_rate(fn, flops: float, runs: int, seconds: float) -> float:
    fn()
    best = 0.0
    for _ in range(runs):
        started, calls = time.perf_counter(), 0
        while time.perf_counter() - started < seconds:
            fn()
            calls += 1
        best = max(best, flops * calls / (time.perf_counter() - started) / 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--out-features", type=int, default=9728)
    parser.add_argument("--in-features", type=int, default=896)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--defines", default="", help="-D settings of the build, e.g. "
                        "'TM_PACK_ROWS=100000'")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.5)
    args = parser.parse_args()
    native_linear.FLAGS = (*native_linear.FLAGS, *(f"-D{d}" for d in args.defines.split()))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weight = torch.randn(args.out_features, args.in_features)
    x = torch.randn(args.rows, args.in_features)
    packed = native_linear.pack(weight)
    native_linear.set_decode_rows(0)
    flops = 2.0 * args.rows * args.out_features * args.in_features
    native = best_rate(lambda: native_linear.linear(x, packed, None, args.out_features),
                       flops, args.runs, args.seconds)
    plain = best_rate(lambda: x @ weight.t(), flops, args.runs, args.seconds)
    print(f"{args.out_features} x {args.in_features}, {args.rows} rows, {args.threads} "
          f"threads, build [{args.defines}]: native {native:.1f} GFLOP/s, torch {plain:.1f}")


if __name__ == "__main__":
    main()
