"""The native float32 kernel against oneDNN and torch per layer shape and row count (GFLOP/s).

The Qwen2.5-0.5B shape's gate/up, down and QKV products at each --rows count, best of
several calls each, every library on the same random weights (torch: the plain weight,
MKL). --panels builds the
native kernel once per row-panel size (the kernel's TM_PANEL; a size above the rows
means no panels) and reports each beside oneDNN; --builds takes any other compile-time
settings, one build per argument (e.g. "TM_CHUNK=128 TM_PANEL=64"); "git:REV" builds
the kernel's sources as they were at git revision REV (e.g. git:HEAD before an
uncommitted change), with any settings after it ("git:HEAD~2 TM_CHUNK=128").
--decode-rows sets every build's decode-tile limit (0: the wide tile, as the engine
sets it on a host that measured it faster).

    python benchmarks/bench_native_rows.py [--rows 256,2048] [--panels 128,100000]
    python benchmarks/bench_native_rows.py --builds TM_CHUNK=256 TM_CHUNK=128
    python benchmarks/bench_native_rows.py --rows 1,8 --copies 8    # weights from memory
    python benchmarks/bench_native_rows.py --rows 1,8 --model-pass --builds A B
    python benchmarks/bench_native_rows.py --rows 512 --fused --builds A B
    python benchmarks/bench_native_rows.py --rows 8,32 --model-pass --fused \\
        --decode-rows 0 --builds "" git:HEAD
    python benchmarks/bench_native_rows.py --rows 1,8 --model-pass --fused \\
        --decode-rows 0 --builds "" --stream-ahead 16,48     # fetch distances

--fused adds each build's gate/up product with the activation in its epilogue (the
engine's gated MLP call) after the plain columns, gate/up rows only.

--model-pass times every product of one decode step of the 0.5B shape instead (24 x
QKV, o, gate/up, down, then the 151936-row LM head; 2 GB of weights in huge pages,
packed once and shared by the builds), the builds alternated pass by pass (--passes
each): the median and fastest pass per build and row count, in ms.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from tokenmill.layers import cpu_blas, huge_pages, native_linear
from tokenmill.layers.native import build_extension, headers
from tokenmill.layers.timing import best_seconds

SHAPES = ((9728, 896), (896, 4864), (1152, 896))  # (out, in): gate/up, down, QKV


def best_rate(fn, flops: float) -> float:
    return flops / best_seconds(fn, max(6, int(4e10 / flops))) / 1e9


def in_turn(kernel, x, weights, *rest) -> None:
    for weight in weights:
        kernel(x, weight, *rest)


def onednn_call(x, weight, _unused) -> None:
    cpu_blas.onednn_linear(x, weight)


def torch_call(x, weight, _unused) -> None:
    torch.mm(x, weight.t())


def model_pass(kernels: dict, rows_list: list[int], passes: int, fused: bool,
               aheads: list[int] | None = None) -> None:
    """Each build's time for one decode step's products, alternated pass by pass (with
    `aheads`, each build at each fetch distance of the rows' class, set before its
    pass)."""
    hidden, intermediate, vocab = 896, 4864, 151936
    shapes = [(1152, hidden), (hidden, hidden), (2 * intermediate, hidden),
              (hidden, intermediate)] * 24 + [(vocab, hidden)]
    with huge_pages.for_weights(True):
        packed = [(native_linear.pack(torch.randn(out, inp) * 0.02), out, inp)
                  for out, inp in shapes]
    print("rows, build: median ms (fastest) of one pass over a decode step's products")
    for rows in rows_list:
        xs = {width: torch.randn(rows, width) for width in (hidden, intermediate)}

        def one_pass(kernel, xs=xs) -> float:
            started = time.perf_counter()
            for weight, out, inp in packed:
                if fused and out == 2 * intermediate:
                    kernel.f32_linear_silu_mul(xs[inp], weight, None, out)
                else:
                    kernel.f32_linear(xs[inp], weight, None, out)
            return (time.perf_counter() - started) * 1e3

        variants = {(f"{build} ahead {ahead}" if aheads else build): (kernel, ahead)
                    for build, kernel in kernels.items() for ahead in (aheads or [None])}
        times = {variant: [] for variant in variants}
        for kernel in kernels.values():
            one_pass(kernel)  # warm-up
        for _ in range(passes):
            for variant, (kernel, ahead) in variants.items():
                if ahead is not None:
                    kernel.set_stream_ahead(ahead, rows)
                times[variant].append(one_pass(kernel))
        for build, spent in times.items():
            print(f"{rows}, {build}: {statistics.median(spent):.1f} ({min(spent):.1f})",
                  flush=True)


def kernel(build: str):
    """The native kernel built with `build`'s -D settings, from the sources of the git
    revision it names first ("git:REV ...") or else from this checkout."""
    source, defines = native_linear.SOURCE, build.split()
    named = bool(defines) and defines[0].startswith("git:")
    revision = defines.pop(0).removeprefix("git:") if named else None
    flags = (*native_linear.FLAGS, *(f"-D{define}" for define in defines))
    if revision is None:
        return build_extension("f32_linear", source, flags)
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"],
                                        text=True).strip())
    # The build copies the sources into its cache directory: this copy can go after.
    with tempfile.TemporaryDirectory(prefix="tokenmill-kernel-") as folder:
        for original in (source, *headers(source)):
            shown = subprocess.run(["git", "show", f"{revision}:"
                                    f"{original.relative_to(root).as_posix()}"],
                                   capture_output=True, text=True)
            if shown.returncode == 0:
                Path(folder, original.name).write_text(shown.stdout)
            elif original == source:  # a header the revision lacks is left out
                raise SystemExit(f"git:{revision}: {shown.stderr.strip()}")
        return build_extension("f32_linear", Path(folder, source.name), flags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,256,2048")
    parser.add_argument("--panels", default="256", help="native builds by TM_PANEL")
    parser.add_argument("--builds", nargs="+", metavar="MACRO=VALUE ...",
                        help="native builds by their -D settings (replaces --panels)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--copies", type=int, default=1,
                        help="weights per shape, called in turn (8: beyond the caches, "
                             "as a decode step reads them)")
    parser.add_argument("--model-pass", action="store_true",
                        help="time a decode step's products of the 0.5B shape per build")
    parser.add_argument("--passes", type=int, default=12)
    parser.add_argument("--decode-rows", type=int, default=None,
                        help="every build's decode-tile limit (default: the build's own)")
    parser.add_argument("--fused", action="store_true",
                        help="also each build's gate/up product with its activation fused")
    parser.add_argument("--stream-ahead", default=None,
                        help="with --model-pass: fetch distances (columns) to time each "
                             "build at, e.g. 16,48 (default: each build's own)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    builds = args.builds or [f"TM_PANEL={int(panel)}" for panel in args.panels.split(",")]
    kernels = {build: kernel(build) for build in builds}
    if args.decode_rows is not None:
        for built in kernels.values():
            built.set_decode_rows(args.decode_rows)
    if args.model_pass:
        aheads = ([int(ahead) for ahead in args.stream_ahead.split(",")]
                  if args.stream_ahead else None)
        return model_pass(kernels, [int(rows) for rows in args.rows.split(",")], args.passes,
                          args.fused, aheads)
    print("out x in, rows: " + ", ".join(f"native {b}" for b in kernels)
          + ("" if not args.fused else ", then fused (gate/up only)")
          + (", oneDNN" if cpu_blas.onednn_available() else "") + ", torch (GFLOP/s)")
    for out_features, in_features in SHAPES:
        weights = [torch.randn(out_features, in_features) for _ in range(args.copies)]
        packed = [native_linear.pack(weight) for weight in weights]
        onednn = ([cpu_blas.onednn_weight(weight, False) for weight in weights]
                  if cpu_blas.onednn_available() else None)
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, in_features)
            flops = 2.0 * rows * out_features * in_features * args.copies
            calls = [functools.partial(in_turn, k.f32_linear, x, packed, None, out_features)
                     for k in kernels.values()]
            if args.fused and out_features == SHAPES[0][0]:
                calls += [functools.partial(in_turn, k.f32_linear_silu_mul, x, packed, None,
                                            out_features) for k in kernels.values()]
            if onednn is not None:
                calls.append(functools.partial(in_turn, onednn_call, x, onednn, None))
            calls.append(functools.partial(in_turn, torch_call, x, weights, None))
            rates = [best_rate(call, flops) for call in calls]
            print(f"{out_features} x {in_features}, {rows}: "
                  + ", ".join(f"{r:.1f}" for r in rates), flush=True)


if __name__ == "__main__":
    main()
