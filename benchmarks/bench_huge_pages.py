"""Weights in transparent huge pages against 4 KB pages, streamed by the native kernel
in one process (so both sets share the host's moment).

--copies packed copies of the 0.5B shape's gate/up weight (9728 x 896, 35 MB each) in
each set, one set advised into huge pages before it is written (layers/huge_pages.py),
the other not; each round multiplies every copy of one set, then of the other (their
order alternating), --rounds times per row count. Prints the weights' read rate, best
and median, per set, and how much of the huge set the system backed with huge pages.

    python benchmarks/bench_huge_pages.py
    python benchmarks/bench_huge_pages.py --rows 1,8,32 --rounds 40
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from tokenmill.layers import huge_pages, native_linear

OUT_FEATURES, IN_FEATURES = 9728, 896


def weights(copies: int, huge: bool) -> list[torch.Tensor]:
    with huge_pages.for_weights(huge):
        return [native_linear.pack(torch.randn(OUT_FEATURES, IN_FEATURES) * 0.05)
                for _ in range(copies)]


def anon_huge_mb() -> float:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = native_linear.library()
    if kernel is None:
        raise SystemExit("the native kernel cannot be built here (no C++ compiler)")
    plain = weights(args.copies, huge=False)
    before = anon_huge_mb()
    huge = weights(args.copies, huge=True)
    gigabytes = args.copies * OUT_FEATURES * IN_FEATURES * 4 / 1e9
    print(f"{args.copies} x {OUT_FEATURES} x {IN_FEATURES} float32 per set "
          f"({gigabytes * 1e3:.0f} MB); huge pages under the huge set: "
          f"{anon_huge_mb() - before:.0f} MB; {args.threads} threads")

    def stream(ws: list[torch.Tensor], x: torch.Tensor) -> float:
        started = time.perf_counter()
        for w in ws:
            kernel.f32_linear(x, w, None, OUT_FEATURES)
        return time.perf_counter() - started

    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, IN_FEATURES)
        stream(plain, x), stream(huge, x)  # warm-up
        seconds: dict[str, list[float]] = {"4 KB pages": [], "huge pages": []}
        for round_ in range(args.rounds):
            order = [("4 KB pages", plain), ("huge pages", huge)]
            for name, ws in order if round_ % 2 else order[::-1]:
                seconds[name].append(stream(ws, x))
        rates = {name: (gigabytes / min(t), gigabytes / statistics.median(t))
                 for name, t in seconds.items()}
        base = rates["4 KB pages"]
        for name, (best, median) in rates.items():
            print(f"rows {rows}: {name:<10} best {best:5.1f} GB/s, median {median:5.1f} GB/s "
                  f"({best / base[0]:.2f}x, {median / base[1]:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
