"""The sparse backends' self-check table for several model shapes: one decode row's
attention on one layer, dense (paged-native) vs sparse, at 1K-16K tokens of context,
per group of layers that cost alike (`probe_classes`: retrieval-topp groups layers by
their number of retrieval heads), exactly as start-up measures it
(tokenmill/attention/crossover.py), and the crossover each group would get.

Shapes other than the model's own use a synthetic calibration (seeded random head
scores, the first 8 rotary pairs as the 16 index dimensions): a real calibration picks
other heads, not other costs.

    python benchmarks/bench_sparse_crossover.py [--calibration models/pycoder-long/sparse_calibration.json]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

from tokenmill.attention.base import AttentionSpec, SparseSettings
from tokenmill.attention.crossover import NEVER, choose_crossover, measure_table
from tokenmill.attention.paged_native import PagedNativeAttention
from tokenmill.attention.registry import ATTENTION_BACKENDS
from tokenmill.attention.sparse_calibration import SparseCalibration
from tokenmill.kv import KVCache

# name: (layers, query heads, KV heads, head dim)
SHAPES = {"pycoder-long": (6, 8, 2, 32), "Qwen2.5-0.5B": (24, 14, 2, 64),
          "Llama-3-8B": (32, 32, 8, 128)}


def synthetic_calibration(layers: int, kv_heads: int, head_dim: int, path: Path) -> None:
    rng = random.Random(0)
    SparseCalibration(layers, kv_heads, head_dim, 16,
                      [[rng.random() for _ in range(kv_heads)] for _ in range(layers)],
                      [[list(range(8))] * kv_heads] * layers, {"synthetic": True}).save(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", default="models/pycoder-long/sparse_calibration.json",
                        help="pycoder-long's own calibration")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}; microseconds dense / sparse per layer")
    print("| shape (K+V bytes per token per layer) | backend (layer group) | 1024 | 2048 | 4096 "
          "| 8192 | 16384 | crossover |")
    print("|" + " --- |" * 8)
    scratch = Path(tempfile.mkdtemp())
    for shape in args.shapes.split(","):
        layers, heads, kv_heads, head_dim = SHAPES[shape]
        path = Path(args.calibration) if shape == "pycoder-long" else scratch / f"{shape}.json"
        if shape != "pycoder-long":
            synthetic_calibration(layers, kv_heads, head_dim, path)
        for name in ("retrieval-topp", "quest"):
            sparse = SparseSettings(budget=2048 if name == "retrieval-topp" else 1024,
                                    dense_layers=2, calibration=str(path), min_context=0)
            backend = ATTENTION_BACKENDS[name](AttentionSpec(layers, heads, kv_heads,
                                                             head_dim, 16, sparse))
            cache = KVCache.allocate(1040, 16, kv_heads, head_dim, torch.float32,
                                     torch.float32, torch.device("cpu"))
            backend.allocate_state([cache] * layers)  # one cache: one layer is timed

            def dense(*call, backend=backend):
                return PagedNativeAttention._decode(backend, *call)

            for tag, group in backend.probe_classes(layers).items():
                table = measure_table(backend, cache, group[0], dense, backend._sparse)
                crossover = choose_crossover(table)
                what = (f"{name} ({tag.replace('-', ' ')} of {kv_heads} KV heads, "
                        f"{len(group)} layers)" if tag else name)
                cells = " | ".join(f"{d * 1e6:.0f} / {s * 1e6:.0f}"
                                   for n, (d, s) in sorted(table.items()) if n >= 1024)
                found = "none: dense" if crossover == NEVER else str(crossover)
                print(f"| {shape} ({kv_heads * head_dim * 8} B) | {what} | {cells} | {found} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
