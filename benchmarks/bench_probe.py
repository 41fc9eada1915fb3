"""The start-up probe of `--cpu-blas auto` (layers/product_table.py), several times in a row.

Each round measures what an engine's first start measures when nothing is stored for
the host (the probe's MLP weights at 1, 8, 32 and 128 rows, every candidate) and prints
the milliseconds per pass and the choice; nothing is written to the cache. --settle
sets the rest after NumPy's passes (product_table.SETTLE_S; 0: none, as before it
existed), so the two can be run one after the other on the same host.

    python benchmarks/bench_probe.py --threads 2 --rounds 3
    python benchmarks/bench_probe.py --threads 2 --rounds 3 --settle 0
"""

from __future__ import annotations

import argparse
import time

from tokenmill.layers import product_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=product_table.SETTLE_S,
                        help="seconds of rest after a spinning library's passes")
    args = parser.parse_args()
    product_table.SETTLE_S = args.settle
    print(f"probe at {args.threads} threads, settle {args.settle} s after "
          f"{sorted(product_table.SPINNING)}; ms per pass of {list(product_table.PROBE_SHAPES)}")
    for round_index in range(args.rounds):
        started = time.perf_counter()
        seconds = product_table.measure(list(product_table.PROBE_SHAPES),
                                        product_table.PROBE_ROWS, args.threads, repeats=3)
        took = time.perf_counter() - started
        cells = "; ".join(f"{c} " + " ".join(f"{seconds[c][n] * 1e3:.2f}" for n in sorted(times))
                          for c, times in seconds.items())
        print(f"round {round_index + 1} ({took:.1f} s), rows {list(product_table.PROBE_ROWS)}: "
              f"{cells} -> {product_table.choose(seconds)}")


if __name__ == "__main__":
    main()
