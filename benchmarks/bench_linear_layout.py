"""Weight layout for CPU linear layers: checkpoint [out, in] via F.linear vs [in, out] via x @ W.

The Qwen2.5-0.5B shapes, at decode (1, 8, 32 rows) and prefill (512 rows) sizes;
or pycoder's at 1, 2, 5, 8 rows (a decode row plus speculative tokens: what a
verification step costs when the weights fit in cache). A/B interleaved, best of N
per round, median over rounds.

    python benchmarks/bench_linear_layout.py [--threads 2] [--rounds 5] [--shapes pycoder]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from tokenmill.layers.timing import best_seconds

SHAPES = {
    "qwen0.5b": ({"qkv_proj": (1152, 896), "o_proj": (896, 896), "gate_up_proj": (9728, 896),
                  "down_proj": (896, 4864), "lm_head": (151936, 896)}, (1, 8, 32, 512)),
    "pycoder": ({"qkv_proj": (384, 256), "o_proj": (256, 256), "gate_up_proj": (1536, 256),
                 "down_proj": (256, 768), "lm_head": (8192, 256)}, (1, 2, 5, 8)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="qwen0.5b")
    args = parser.parse_args()
    shapes, row_counts = SHAPES[args.shapes]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print("| layer (out x in) | rows | F.linear [out,in] ms | x @ W [in,out] ms | speed-up |")
    print("| --- | --- | --- | --- | --- |")
    for name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features)
        weight_t = weight.t().contiguous()
        for rows in row_counts:
            if name == "lm_head" and rows == 512:
                continue
            x = torch.randn(rows, in_features)
            linear, matmul = [], []
            for _ in range(args.rounds):
                linear.append(best_seconds(lambda x=x, w=weight: F.linear(x, w), 10))
                matmul.append(best_seconds(lambda x=x, w=weight_t: x @ w, 10))
            a, b = statistics.median(linear) * 1e3, statistics.median(matmul) * 1e3
            print(f"| {name} ({out_features}x{in_features}) | {rows} | {a:.3f} | {b:.3f} "
                  f"| {a / b:.2f}x |")


if __name__ == "__main__":
    main()
