"""Decode attention per layer: the paged backend's gather + masked SDPA against the
paged-native kernel reading the block pool in place (issue 16).

For each batch size and context (and a mixed-length batch), one layer's cache is
filled with random K/V in shuffled blocks, as a long-running pool is, and both paths
compute the same decode step (one query token per request): `paged` as the engine
runs it (KVCache.gather of the padded block tables, then grouped_decode_attention
under the length mask) and `paged-native` (csrc/paged_decode.cpp). Interleaved
rounds, best of --repeats per round, median over rounds; outputs are checked equal.

    python benchmarks/bench_paged_attention.py [--heads 14 --kv-heads 2 --head-dim 64]
        [--batches 1,8,32] [--contexts 1024,4096,16384] [--threads 2] [--json F] [--plot F]
        [--baseline REV]

--baseline REV adds the kernel as it was at a git revision (built from that revision's
csrc beside this one's), timed in the same rounds: a kernel change's A/B in one process.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from tokenmill.attention import paged_native
from tokenmill.attention.paged import grouped_decode_attention
from tokenmill.attention.paged_native import native_decode
from tokenmill.kv import KVCache

BLOCK = 16


def case(batch: int, lengths: list[int], heads: int, kv_heads: int, head_dim: int):
    blocks_per_row = [-(-n // BLOCK) for n in lengths]
    total = sum(blocks_per_row) + 1
    cache = KVCache.allocate(total, BLOCK, kv_heads, head_dim, torch.float32, torch.float32,
                             torch.device("cpu"))
    cache.data.normal_()
    order = list(range(1, total))
    random.Random(0).shuffle(order)
    width = max(blocks_per_row)
    tables, start = [], 0
    for count in blocks_per_row:
        own = order[start:start + count]
        start += count
        tables.append(own + [0] * (width - count))
    tables = torch.tensor(tables, dtype=torch.int64)
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    q = torch.randn(batch, heads, head_dim)
    positions = torch.arange(width * BLOCK)
    mask = (positions[None, :] < lengths_t[:, None])[:, None, None, :]
    return cache, tables, lengths_t, q, mask


def baseline_kernel(revision: str):
    """The paged_decode kernel built from its sources at a git revision."""
    from tokenmill.layers.native import build_extension

    folder = Path(tempfile.mkdtemp(prefix="paged-decode-"))
    source = Path(paged_native.SOURCE)
    for path in source.parent.iterdir():
        if path.suffix in (".cpp", ".h"):
            relative = path.relative_to(Path(__file__).resolve().parents[1])
            text = subprocess.run(["git", "show", f"{revision}:{relative}"], check=True,
                                  capture_output=True, text=True).stdout
            (folder / path.name).write_text(text)
    return build_extension("paged_decode", folder / source.name, ("-ffast-math",))


def time_paths(cache, tables, lengths, q, mask, scale, rounds, repeats, baseline=None):
    kernel = native_decode()

    def gathered():
        keys, values = cache.gather(tables)
        return grouped_decode_attention(q, keys, values, mask, 1, scale)

    def native():
        return kernel.paged_decode(q, cache.data[0], cache.data[1], tables, lengths, scale)

    def before():
        return baseline.paged_decode(q, cache.data[0], cache.data[1], tables, lengths, scale)

    torch.testing.assert_close(native(), gathered(), atol=1e-5, rtol=1e-4)
    paths = [("paged", gathered), ("paged-native", native)]
    if baseline is not None:
        torch.testing.assert_close(native(), before(), atol=1e-5, rtol=1e-4)
        paths.append(("baseline", before))
    results = {name: [] for name, _ in paths}
    for _ in range(rounds):
        for name, fn in paths:
            best = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - started)
            results[name].append(best)
    return {name: statistics.median(times) for name, times in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--baseline", metavar="REV",
                        help="also time the kernel as built at this git revision")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native_decode() is None:
        raise SystemExit("the paged-native kernel could not be built here")
    scale = args.head_dim ** -0.5
    cases = [(b, [c] * b, f"{c}") for b in map(int, args.batches.split(","))
             for c in map(int, args.contexts.split(","))]
    top = max(map(int, args.contexts.split(",")))
    rng = random.Random(1)
    for b in map(int, args.batches.split(",")):
        if b > 1:  # mixed: lengths spread from 256 to the longest context
            cases.append((b, [rng.randint(256, top) for _ in range(b)], f"mixed 256-{top}"))
    print(f"{args.heads} heads / {args.kv_heads} KV heads x {args.head_dim}, block {BLOCK}, "
          f"{args.threads} threads; ms per layer per decode step (median of {args.rounds} "
          f"rounds, best of {args.repeats})")
    baseline = baseline_kernel(args.baseline) if args.baseline else None
    extra = f" {args.baseline} ms | this / {args.baseline} |" if baseline else ""
    print(f"| batch | context | paged ms | paged-native ms | speed-up | K/V MB read |{extra}")
    print("| --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if baseline else ""))
    rows = []
    for batch, lengths, label in cases:
        data = case(batch, lengths, args.heads, args.kv_heads, args.head_dim)
        times = time_paths(*data, scale, args.rounds, args.repeats, baseline)
        megabytes = sum(lengths) * args.kv_heads * args.head_dim * 4 * 2 / 1e6
        row = {"batch": batch, "context": label, "paged_ms": times["paged"] * 1e3,
               "native_ms": times["paged-native"] * 1e3,
               "speedup": times["paged"] / times["paged-native"], "kv_mb": megabytes}
        extra = ""
        if baseline is not None:
            row["baseline_ms"] = times["baseline"] * 1e3
            extra = f" {row['baseline_ms']:.3f} | {times['baseline'] / times['paged-native']:.2f}x |"
        rows.append(row)
        print(f"| {batch} | {label} | {row['paged_ms']:.3f} | {row['native_ms']:.3f} | "
              f"{row['speedup']:.2f}x | {megabytes:.1f} |{extra}", flush=True)
        del data
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    labels = [f"b{r['batch']}\n{r['context']}" for r in rows]
    axes.bar(range(len(rows)), [r["speedup"] for r in rows])
    axes.axhline(1.0, color="gray", linestyle="--")
    axes.set_xticks(range(len(rows)))
    axes.set_xticklabels(labels, fontsize=7)
    axes.set_ylabel("paged-native speed-up over paged (gather + SDPA)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
