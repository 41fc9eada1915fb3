"""CPU matrix products: torch (MKL) vs NumPy's OpenBLAS vs oneDNN on a packed weight,
as tokenmill calls them (layers/cpu_blas.py).

1. Per layer shape and row count: torch's faster layout (F.linear on [out, in] or
   x @ W on [in, out]) vs `cpu_blas.matmul` (x @ W through NumPy, partial 8-row
   panels padded) vs `cpu_blas.onednn_linear` (weight packed once). Best of N per
   round, median over interleaved rounds.
2. A decoder-like pass (24 layers of distinct 0.5B-shape weights, out of cache, small
   torch ops between the products, then the LM head) at 1 to 1024 rows: torch;
   NumPy with torch's pool at full size; NumPy with torch on one thread (what an
   engine step does on that path); oneDNN. The second case shows why torch's pool
   must be shrunk during a step on the NumPy path.

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
    print("| layer (out x in) | rows | torch ms (faster layout) | NumPy OpenBLAS ms "
          "| oneDNN ms | OpenBLAS vs torch | oneDNN vs torch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features)
        weight_t = weight.t().contiguous()
        blas_weight = weight_t.numpy()
        packed = cpu_blas.onednn_weight(weight, transposed=False)
        for rows in row_counts:
            if name == "lm_head" and rows == 512:
                continue
            x = torch.randn(rows, in_features)
            torch_s, blas_s, dnn_s = [], [], []
            for _ in range(rounds):
                torch.set_num_threads(threads)
                torch_s.append(min(best_time(lambda x=x, w=weight: F.linear(x, w)),
                                   best_time(lambda x=x, w=weight_t: x @ w)))
                dnn_s.append(best_time(lambda x=x, p=packed: cpu_blas.onednn_linear(x, p)))
                with cpu_blas.single_torch_thread():
                    blas_s.append(best_time(lambda x=x, w=blas_weight: cpu_blas.matmul(x, w)))
            a, b, c = (statistics.median(t) * 1e3 for t in (torch_s, blas_s, dnn_s))
            print(f"| {name} ({out_features}x{in_features}) | {rows} | {a:.3f} | {b:.3f} "
                  f"| {c:.3f} | {a / b:.2f}x | {a / c:.2f}x |")


def decoder_pass(threads: int, rounds: int, row_counts: tuple) -> None:
    shapes, _ = SHAPES["qwen0.5b"]
    # Scaled like trained weights, so the activations stay finite over 24 layers.
    layers = [{name: (0.02 * torch.randn(o, i)).t().contiguous()
               for name, (o, i) in shapes.items() if name != "lm_head"} for _ in range(24)]
    lm_head = 0.02 * torch.randn(896, 151936)
    # The same weights packed for oneDNN, keyed by the [in, out] tensor's identity.
    packed = {id(w): cpu_blas.onednn_weight(w, transposed=True)
              for w in [lm_head, *(w for layer in layers for w in layer.values())]}
    total_bytes = 4 * (sum(w.numel() for layer in layers for w in layer.values())
                       + lm_head.numel())
    body_flops = 2 * sum(w.numel() for layer in layers for w in layer.values())

    def run(product, rows: int) -> None:
        x = torch.randn(rows, 896)
        for layer in layers:
            product(x, layer["qkv_proj"])
            x = x + 0.01 * product(torch.tanh(x), layer["o_proj"])
            gate, up = product(x, layer["gate_up_proj"]).chunk(2, dim=-1)
            x = x + 0.001 * product(F.silu(gate) * up, layer["down_proj"])
        product(x[-1:], lm_head)  # logits of one row, as in a prefill

    def numpy_product(x, w):
        return cpu_blas.matmul(x, w.numpy())

    def onednn_product(x, w):
        return cpu_blas.onednn_linear(x, packed[id(w)])

    def torch_run(rows):
        torch.set_num_threads(threads)
        return best_time(lambda: run(torch.matmul, rows), 3)

    def numpy_full_pool(rows):
        torch.set_num_threads(threads)
        return best_time(lambda: run(numpy_product, rows), 3)

    def numpy_one_thread(rows):
        with cpu_blas.single_torch_thread():
            return best_time(lambda: run(numpy_product, rows), 3)

    def onednn_run(rows):
        torch.set_num_threads(threads)
        return best_time(lambda: run(onednn_product, rows), 3)

    starved = f"NumPy, torch pool {threads} threads"
    cases = {"torch (MKL)": torch_run, starved: numpy_full_pool,
             "NumPy, torch pool 1 thread (engine step, numpy)": numpy_one_thread,
             "oneDNN, packed weights (engine step, onednn)": onednn_run}
    print(f"\nDecoder-like pass, {total_bytes / 1e9:.2f} GB of weights "
          f"(ms; GB/s at one row, GFLOP/s of the layers' products above):")
    print("| products by | " + " | ".join(f"{r} rows" for r in row_counts) + " |")
    print("| --- " * (len(row_counts) + 1) + "|")
    for name, case in cases.items():
        cells = []
        for rows in row_counts:
            if rows > 64 and name == starved:
                cells.append("-")  # the starved case: minutes, and it proves nothing new
                continue
            seconds = statistics.median(case(rows) for _ in range(rounds))
            rate = (f"{total_bytes / seconds / 1e9:.0f} GB/s" if rows == 1
                    else f"{body_flops * rows / seconds / 1e9:.0f} GFLOP/s")
            cells.append(f"{seconds * 1e3:.1f} ({rate})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


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
            decoder_pass(args.threads, args.rounds, (1, 2, 8, 32, 256, 1024))


if __name__ == "__main__":
    main()
