"""A/B two commits of tokenmill on this machine, in one run, interleaved.

Each side is a git worktree; each repetition runs ab_probe.py once per side in a
fresh process (order alternating A B, B A, ...), so drift of the machine falls on
both alike. Prints per figure the median of each side, the spread of its
repetitions (the run's own noise) and the ratio B / A (for times: A / B, so > 1 is
always "B faster").

    python benchmarks/bench_ab.py --a dd8f27a --b HEAD --suites core spec --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "benchmarks" / "ab_probe.py"


def worktree(ref: str, where: Path) -> Path:
    """A checkout of ref (the working tree itself when ref is 'WORKTREE')."""
    if ref == "WORKTREE":
        return ROOT
    path = where / ref.replace("/", "_")
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path),
                        ref], check=True)
    return path


def probe(tree: Path, suite: str, out: Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree), TOKENIZERS_PARALLELISM="false")
    subprocess.run([sys.executable, str(PROBE), "--suite", suite, "--json", str(out)],
                   check=True, env=env, cwd=tempfile.gettempdir())
    return json.loads(out.read_text())


def summarize(figures: dict[str, dict[str, list[float]]], a: str, b: str) -> list[str]:
    lines = [f"| figure | {a} median (min-max) | {b} median (min-max) | {b} vs {a} |",
             "| --- | --- | --- | --- |"]
    for name in figures[a]:
        va, vb = figures[a][name], figures[b][name]
        ma, mb = statistics.median(va), statistics.median(vb)
        ratio = ma / mb if "ms" in name else mb / ma  # > 1: b faster
        lines.append(f"| {name} | {ma:.2f} ({min(va):.2f}-{max(va):.2f}) | "
                     f"{mb:.2f} ({min(vb):.2f}-{max(vb):.2f}) | {ratio:.3f}x |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="baseline git ref")
    parser.add_argument("--b", default="WORKTREE", help="candidate git ref (default: this tree)")
    parser.add_argument("--suites", nargs="+", default=["core", "spec"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    where = Path(tempfile.gettempdir()) / "tokenmill-ab"
    where.mkdir(exist_ok=True)
    trees = {args.a: worktree(args.a, where), args.b: worktree(args.b, where)}
    figures: dict[str, dict[str, list[float]]] = {args.a: {}, args.b: {}}
    for rep in range(args.repeats):
        order = [args.a, args.b] if rep % 2 == 0 else [args.b, args.a]
        for suite in args.suites:
            for ref in order:
                result = probe(trees[ref], suite, where / f"{suite}.json")
                for name, value in result.items():
                    figures[ref].setdefault(name, []).append(value)
                print(f"rep {rep + 1} {suite} {ref}: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in result.items()), flush=True)
    print(f"\nmachine: {platform.machine()} {os.cpu_count()} cores; {args.repeats} repetitions")
    print("\n".join(summarize(figures, args.a, args.b)))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
