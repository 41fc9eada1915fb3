"""`tokenmill bench collectives`: all-reduce latency and bus bandwidth on this machine, by
algorithm (the backend's, and tokenmill's ring, tree and recursive halving-doubling),
message size and number of processes, with an alpha-beta fit per algorithm.

Each configuration runs in fresh processes (gloo over loopback); rank 0 times each
all-reduce between barriers and keeps the median of the repetitions. The fit is least
squares of time = A + B bytes per algorithm and process count; alpha and beta follow
from the algorithm's formula (plan/collective_cost.py), so they are comparable. The
backend's alpha and beta at 2 processes are saved for `tokenmill plan parallel`'s
local cluster (plan/clusters.py).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenmill.dist.collectives import ALGORITHMS, all_reduce
from tokenmill.executor.multiprocess import free_port
from tokenmill.plan.clusters import calibration_path

DEFAULT_SIZES = [2**k for k in range(10, 27, 2)]  # 1 KB .. 64 MB


def _measure(rank: int, world: int, port: int, sizes: list[int], repeats: int,
             results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    timings: dict[str, dict[int, float]] = {}
    for algorithm in ALGORITHMS:
        for size in sizes:
            tensor = torch.ones(size // 4)
            all_reduce(tensor, algorithm)  # warm-up (connections, buffers)
            samples = []
            for _ in range(repeats):
                dist.barrier()
                started = time.perf_counter()
                all_reduce(tensor, algorithm)
                samples.append(time.perf_counter() - started)
            timings.setdefault(algorithm, {})[size] = statistics.median(samples)
    if rank == 0:
        results.put(timings)
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_measure, args=(r, world, port, sizes, repeats, results))
                 for r in range(world)]
    for process in processes:
        process.start()
    timings = results.get()
    for process in processes:
        process.join()
    return timings


def coefficients(algorithm: str, ranks: int) -> tuple[float, float]:
    """(latency terms, bandwidth terms) of an algorithm: time = a alpha + b n / beta."""
    log_p = math.log2(ranks)
    if algorithm == "tree":
        return 2 * math.ceil(log_p), 2.0
    if algorithm == "rhd":
        return 2 * math.floor(log_p), 2 * (ranks - 1) / ranks
    return 2 * (ranks - 1), 2 * (ranks - 1) / ranks  # ring, and gloo's own (a ring)


def fit(timings: dict[int, float], algorithm: str, ranks: int) -> dict[str, float]:
    """Least squares time = A + B bytes; alpha and beta by the algorithm's formula."""
    xs, ys = list(timings), list(timings.values())
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
             / sum((x - mean_x) ** 2 for x in xs))
    intercept = mean_y - slope * mean_x
    predicted = [intercept + slope * x for x in xs]
    total = sum((y - mean_y) ** 2 for y in ys)
    r2 = 1 - sum((y - p) ** 2 for y, p in zip(ys, predicted, strict=True)) / total
    a, b = coefficients(algorithm, ranks)
    return {"alpha_s": max(intercept, 0.0) / a, "beta_bytes_per_s": b / slope if slope > 0
            else float("inf"), "r2": r2, "ranks": ranks}


def add_collectives_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8],
                        help="process counts to run (each is one process per rank on "
                             "this host)")
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES,
                        help="message sizes in bytes")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed all-reduces per size and algorithm (median kept)")
    parser.add_argument("--out", type=Path, default=Path("collectives"),
                        help="folder for collectives.json and collectives.png")
    parser.add_argument("--log-level", default="warning")
    parser.set_defaults(func=cmd_bench_collectives)


def cmd_bench_collectives(args: argparse.Namespace) -> int:
    report = {}
    for world in args.ranks:
        timings = measure(world, args.sizes, args.repeats)
        report[world] = {alg: {"seconds": t, "fit": fit(t, alg, world)}
                         for alg, t in timings.items()}
        print_table(world, report[world])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "collectives.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "collectives.png")
    if 2 in report:
        calibration_path().parent.mkdir(parents=True, exist_ok=True)
        calibration_path().write_text(json.dumps({alg: r["fit"] for alg, r in report[2].items()}))
    print(f"wrote {args.out / 'collectives.json'}, {args.out / 'collectives.png'} and the "
          f"planner's calibration {calibration_path()}")
    return 0


def print_table(world: int, results: dict) -> None:
    sizes = list(next(iter(results.values()))["seconds"])
    print(f"\n{world} processes: median all-reduce time in microseconds (bus bandwidth GB/s)")
    print("| bytes | " + " | ".join(results) + " |")
    print("| --- |" + " --- |" * len(results))
    for size in sizes:
        cells = []
        for algorithm in results:
            seconds = results[algorithm]["seconds"][size]
            busbw = size / seconds * 2 * (world - 1) / world / 1e9
            cells.append(f"{seconds * 1e6:.0f} ({busbw:.2f})")
        print(f"| {size} | " + " | ".join(cells) + " |")
    print("| fit: alpha us, beta GB/s, R^2 | " + " | ".join(
        f"{r['fit']['alpha_s'] * 1e6:.1f}, {r['fit']['beta_bytes_per_s'] / 1e9:.2f}, "
        f"{r['fit']['r2']:.3f}" for r in results.values()) + " |")
    crossing = next((size for size in sizes if results["ring"]["seconds"][size]
                     < results["tree"]["seconds"][size]), None)
    print(f"ring faster than tree from {crossing} bytes" if crossing else
          "the tree was never slower than the ring")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(report), figsize=(5 * len(report), 4), squeeze=False)
    for axis, (world, results) in zip(axes[0], report.items(), strict=True):
        for algorithm, result in results.items():
            sizes = list(result["seconds"])
            axis.loglog(sizes, [result["seconds"][s] * 1e6 for s in sizes], marker="o",
                        label=algorithm)
        axis.set_title(f"{world} processes")
        axis.set_xlabel("message bytes")
        axis.set_ylabel("all-reduce time (us)")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)
