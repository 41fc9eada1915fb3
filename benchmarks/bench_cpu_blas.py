"""CPU matrix products: torch (MKL) vs NumPy's OpenBLAS as tokenmill calls it (cpu_blas).

1. Per layer shape and row count: torch's faster layout (F.linear on [out, in] or
   x @ W on [in, out]) vs `cpu_blas.matmul` (x @ W through NumPy, partial 8-row
   panels padded). Best of N per round, median over interleaved rounds.
2. A decoder-like pass (24 layers of distinct 0.5B-shape weights, out of cache, small
   torch ops between the products, then the LM head): torch; NumPy with torch's
   pool at full size; NumPy with torch on one thread (what an engine step does).
   This is the case that shows why torch's pool must be shrunk during a step.

    python benchmarks/bench_cpu_blas.py [--threads 2] [--rounds 3] [--shapes qwen0.5b|pycoder]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from bench_linear_layout import SHAPES as LAYER_SHAPES  # same directory
from bench_linear_layout import best_time
from threadpoolctl import threadpool_limits

from tokenmill.layers import cpu_blas

# The layer shapes of bench_linear_layout, at more row counts.
SHAPES = {
    "qwen0.5b": (LAYER_SHAPES["qwen0.5b"][0], (1, 2, 5, 8, 12, 16, 32, 64, 512)),
    "pycoder": (LAYER_SHAPES["pycoder"][0], (1, 2, 5, 8, 16, 32)),
}


def per_layer(shapes: dict, row_counts: tuple, rounds: int, threads: int) -> None:
    print("| layer (out x in) | rows | torch ms (faster layout) | NumPy OpenBLAS ms | speed-up |")
    print("| --- | --- | --- | --- | --- |")
    for name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features)
        weight_t = weight.t().contiguous()
        blas_weight = weight_t.numpy()
        for rows in row_counts:
            if name == "lm_head" and rows == 512:
                continue
            x = torch.randn(rows, in_features)
            torch_s, blas_s = [], []
            for _ in range(rounds):
                torch.set_num_threads(threads)
                torch_s.append(min(best_time(lambda x=x, w=weight: F.linear(x, w)),
                                   best_time(lambda x=x, w=weight_t: x @ w)))
                with cpu_blas.single_torch_thread():
                    blas_s.append(best_time(lambda x=x, w=blas_weight: cpu_blas.matmul(x, w)))
            a, b = statistics.median(torch_s) * 1e3, statistics.median(blas_s) * 1e3
            print(f"| {name} ({out_features}x{in_features}) | {rows} | {a:.3f} | {b:.3f} "
                  f"| {a / b:.2f}x |")


def decoder_pass(threads: int, rounds: int) -> None:
    shapes, _ = SHAPES["qwen0.5b"]
    layers = [{name: torch.randn(o, i).t().contiguous() for name, (o, i) in shapes.items()
               if name != "lm_head"} for _ in range(24)]
    lm_head = torch.randn(896, 151936)
    total_bytes = 4 * (sum(w.numel() for layer in layers for w in layer.values())
                       + lm_head.numel())

    def run(product) -> None:
        x = torch.randn(1, 896)
        for layer in layers:
            product(x, layer["qkv_proj"])
            x = x + 0.01 * product(torch.tanh(x), layer["o_proj"])
            gate, up = product(x, layer["gate_up_proj"]).chunk(2, dim=-1)
            x = x + 0.001 * product(F.silu(gate) * up, layer["down_proj"])
        product(x, lm_head)

    def numpy_product(x, w):
        return cpu_blas.matmul(x, w.numpy())

    def torch_run():
        torch.set_num_threads(threads)
        return best_time(lambda: run(torch.matmul), 5)

    def numpy_full_pool():
        torch.set_num_threads(threads)
        return best_time(lambda: run(numpy_product), 5)

    def numpy_one_thread():
        with cpu_blas.single_torch_thread():
            return best_time(lambda: run(numpy_product), 5)

    cases = {"torch (MKL)": torch_run, f"NumPy, torch pool {threads} threads": numpy_full_pool,
             "NumPy, torch pool 1 thread (engine step)": numpy_one_thread}
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, case in cases.items():
            times[name].append(case())
    print(f"\nDecoder-like pass, one row, {total_bytes / 1e9:.2f} GB of weights:")
    print("| products by | ms | GB/s |")
    print("| --- | --- | --- |")
    for name, values in times.items():
        seconds = statistics.median(values)
        print(f"| {name} | {seconds * 1e3:.1f} | {total_bytes / seconds / 1e9:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="qwen0.5b")
    args = parser.parse_args()
    torch.manual_seed(0)
    with threadpool_limits(limits=args.threads, user_api="blas"):
        per_layer(*SHAPES[args.shapes], args.rounds, args.threads)
        if args.shapes == "qwen0.5b":
            decoder_pass(args.threads, args.rounds)


if __name__ == "__main__":
    main()
