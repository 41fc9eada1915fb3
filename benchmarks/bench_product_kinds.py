"""Each product kind of a decode step, timed from C++: GB/s per kind of weight.

One pass multiplies the 0.5B shape's 24 layers' QKV, o, gate/up (with its activation,
as the engine's stack calls it) and down weights, then the LM head, through the native
kernel's entry points from a compiled loop (csrc/product_pass.cpp: no Python between
the calls), each call timed. Per kind: the median over passes of its summed time,
and the rate its weights stream at. Builds (--builds, bench_native_rows.py's
settings) and fetch distances of a few rows' tiles (--stream-ahead, columns, set at
run time; layers/fetch_distance.py) alternate pass by pass in one process; --arena copies the packed weights
into one 2 MB-aligned allocation first (layers/weight_arena.py's layout), against
`pack`'s one allocation per weight.

    python benchmarks/bench_product_kinds.py [--rows 1,8] [--builds "" "TM_STREAM_AHEAD=32"]
    python benchmarks/bench_product_kinds.py --arena
    python benchmarks/bench_product_kinds.py --arena --stream-ahead 64 48 32 16
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from bench_native_rows import kernel

from tokenmill.bench.ceilings import host_description
from tokenmill.layers import huge_pages, native_linear, weight_arena
from tokenmill.layers.native import build_extension

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 896, 4864, 151936, 24
KINDS = {"qkv": (1152, HIDDEN), "o": (HIDDEN, HIDDEN), "gate/up": (2 * INTERMEDIATE, HIDDEN),
         "down": (HIDDEN, INTERMEDIATE)}
PASS = Path(__file__).resolve().parent / "csrc" / "product_pass.cpp"


def weights(arena: bool) -> list[tuple[str, torch.Tensor]]:
    """(kind, packed weight) in a decode step's order, in huge pages."""
    shapes = [(kind, shape) for _ in range(LAYERS) for kind, shape in KINDS.items()]
    shapes.append(("head", (VOCAB, HIDDEN)))
    with huge_pages.for_weights(True):
        packed = [(kind, native_linear.pack(torch.randn(*shape) * 0.02))
                  for kind, shape in shapes]
        if not arena:
            return packed
        step = weight_arena.ALIGN // 4
        spans = [-(-w.numel() // step) * step for _, w in packed]
        flat = weight_arena.arena(sum(spans) * 4, torch.float32)
        laid_out, offset = [], 0
        for (kind, w), span in zip(packed, spans, strict=True):
            laid_out.append((kind, flat[offset:offset + w.numel()].view(w.shape).copy_(w)))
            offset += span
        return laid_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1", help="row counts, comma-separated (1,8,16)")
    parser.add_argument("--builds", nargs="+", default=[""], metavar="MACRO=VALUE ...")
    parser.add_argument("--decode-rows", type=int, default=None,
                        help="every build's decode-tile limit (default: the build's own)")
    parser.add_argument("--stream-ahead", nargs="+", type=int, default=[None],
                        metavar="COLUMNS", help="fetch distances (default: the build's)")
    parser.add_argument("--arena", action="store_true")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--passes", type=int, default=3, help="per build per round")
    args = parser.parse_args()
    print(host_description())
    timer = build_extension("product_pass", PASS)
    libraries = {build: kernel(build) for build in args.builds}
    if args.decode_rows is not None:
        for library in libraries.values():
            library.set_decode_rows(args.decode_rows)
    variants = {(build, columns): library for build, library in libraries.items()
                for columns in args.stream_ahead}
    packed = weights(args.arena)
    kinds = [kind for kind, _ in packed]
    fused = [kind == "gate/up" for kind in kinds]
    row_counts = [int(r) for r in args.rows.split(",")]
    xs = {rows: [torch.randn(rows, w.shape[1]) for _, w in packed] for rows in row_counts}
    outs = {rows: [torch.empty(rows, w.shape[0] * native_linear.LANES // (2 if f else 1))
                   for (_, w), f in zip(packed, fused, strict=True)] for rows in row_counts}
    seconds: dict[tuple, list[torch.Tensor]] = {
        (rows, *variant): [] for rows in row_counts for variant in variants}
    for round_ in range(args.rounds + 1):  # the first warms up
        for rows in row_counts:  # every row count and variant in turn, round by round
            for variant, library in variants.items():
                library.set_stream_ahead(variant[1] if variant[1] is not None
                                         else library.built_stream_ahead)
                entries = library.entry_points()
                times = timer.product_pass(entries["f32_linear_into"],
                                           entries["f32_linear_silu_mul_into"],
                                           [w for _, w in packed], fused, xs[rows],
                                           outs[rows], args.passes)
                if round_:
                    seconds[(rows, *variant)].append(times)
    report(seconds, packed, kinds, args.arena)


def report(seconds: dict[tuple, list[torch.Tensor]], packed, kinds, arena: bool) -> None:
    """Per row count, per build and fetch distance: each kind's median ms a pass and GB/s."""
    shown = None
    for (rows, build, columns), runs in seconds.items():
        if rows != shown:
            shown = rows
            print(f"{rows} rows, weights {'in one arena' if arena else 'one by one'}: "
                  "median ms a pass per kind (GB/s)")
        times = torch.cat(runs)
        cells = []
        for kind in (*KINDS, "head"):
            picked = [i for i, k in enumerate(kinds) if k == kind]
            spent = statistics.median(times[:, picked].sum(1).tolist())
            nbytes = sum(packed[i][1].numel() * 4 for i in picked)
            cells.append(f"{kind} {spent * 1e3:.2f} ({nbytes / spent / 1e9:.1f})")
        total = statistics.median(times.sum(1).tolist())
        name = build or "build default"
        if columns is not None:
            name += f", {columns} columns ahead"
        print(f"[{name}] " + " | ".join(cells) + f" | pass {total * 1e3:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
