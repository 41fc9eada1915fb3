"""A neighbour that takes part of one core: busy for --busy-ms, asleep for --idle-ms, for
--seconds. Run beside a benchmark to see how a kernel holds up when the OS hands one of
its threads' cores to another process now and then (as a served engine's clients and
event loop do on a 2-core host):

    python benchmarks/busy_core.py --busy-ms 2 --idle-ms 6 --seconds 100 &
    python benchmarks/bench_native_rows.py --rows 1,8,32 --model-pass \\
        --builds "TM_STEAL=0" "TM_STEAL=1"
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--idle-ms", type=float, default=6.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        while time.perf_counter() - start < args.busy_ms / 1000:
            pass
        time.sleep(args.idle_ms / 1000)


if __name__ == "__main__":
    main()
