"""Where `tokenmill generate`'s start-up goes: command to first token, split into phases.

Each run starts a fresh interpreter that runs `tokenmill generate --max-tokens 1` with
the loader's two steps wrapped, and prints per phase the wall seconds, the minor page
faults and the kernel's and the process's CPU seconds (getrusage):

    imports              torch and tokenmill, up to the command line
    up to the weights    the command line, the engine's modules, the model on the meta
                         device and its parameters allocated
    weights copied in    the checkpoint read into the parameters (loader.iterate_weights)
    linear finalize      each Linear's method preparing its form (the native pack)
    to the first token   KV pool, warm-up, the probe (when nothing is stored), one token

The interpreter's own start is outside the phases: the total is also timed from outside.

    python benchmarks/bench_startup.py --runs 3
    python benchmarks/bench_startup.py --runs 3 -- --cpu-blas onednn   # engine flags
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import MODEL_DIR, build_model  # noqa: E402

CHILD = r"""
import resource, sys, time
def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), r.ru_minflt, r.ru_stime, r.ru_utime
marks = [("", usage())]
def mark(name):
    marks.append((name, usage()))
import torch
import tokenmill.model.loader as loader
from tokenmill.cli import main
mark("imports")
iterate, finalize = loader.iterate_weights, loader.finalize_linear_methods
def iterate_weights(*args, **kwargs):
    mark("up to the weights")
    yield from iterate(*args, **kwargs)
    mark("weights copied in")
def finalize_linear_methods(model):
    finalize(model)
    mark("linear finalize")
loader.iterate_weights, loader.finalize_linear_methods = iterate_weights, finalize_linear_methods
main(["generate", "--model", sys.argv[1], "--prompt", "def f", "--max-tokens", "1",
      *sys.argv[2:]])
mark("to the first token")
for (_, before), (name, after) in zip(marks, marks[1:]):
    print(f"PHASE {name}|{after[0] - before[0]:.2f}|{after[1] - before[1]}|"
          f"{after[2] - before[2]:.2f}|{after[3] - before[3]:.2f}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the random 0.5B shape")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("engine_flags", nargs="*", help="after --: tokenmill generate flags")
    args = parser.parse_args()
    model = args.model or str(build_model(MODEL_DIR))
    print(f"start-up of `tokenmill generate --model {model} --max-tokens 1 "
          f"{' '.join(args.engine_flags)}`")
    for run in range(1, args.runs + 1):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", CHILD, model, *args.engine_flags],
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode:
            sys.exit(f"run {run} failed:\n{done.stderr[-2000:]}")
        print(f"\nrun {run}: {wall:.2f} s from the command to its exit")
        print(f"  {'phase':20s} {'s':>6s} {'faults':>8s} {'sys s':>6s} {'user s':>6s}")
        for line in done.stdout.splitlines():
            if line.startswith("PHASE "):
                name, *values = line[6:].split("|")
                print(f"  {name:20s} {values[0]:>6s} {values[1]:>8s} {values[2]:>6s} "
                      f"{values[3]:>6s}")


if __name__ == "__main__":
    main()
