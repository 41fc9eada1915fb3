"""Timing a callable for measured choices (kernel tables, machine ceilings), and what a
measured choice is keyed by: the CPU, in the cache directory."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from tokenmill.layers.isa import capped_isa

# Where measured choices (and compiled kernels) are kept between runs.
CACHE = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


def cpu_signature() -> str:
    """The CPU model and instruction-set flags (kernels' speeds and builds differ by them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = [f"model name: {platform.processor()}"]
    wanted = ("model name", "flags")
    signature = "|".join(next((ln for ln in lines if ln.startswith(w)), "") for w in wanted)
    isa = capped_isa()  # a capped run's choices and builds are its own
    return f"{signature}|capped at {isa}" if isa else signature


def host_available_memory() -> int:
    """Bytes of memory available to a new allocation on this host: MemAvailable, or the
    free pages where /proc/meminfo cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def median_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time of `repeats` calls of fn, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def best_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    """Shortest wall time of `repeats` calls of fn, after one untimed warm-up call (for
    comparing two forms of the same work on a noisy machine)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
