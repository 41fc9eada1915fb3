"""`tokenmill tune`: measure on this machine which float32 product path serves a model
fastest, and make it what `--cpu-blas auto` takes here (layers/product_table.py).

For the model's own layer shapes (one decoder layer's projections, a MoE layer's
router and top-k experts, times the layers, plus the LM head) every candidate
(oneDNN packed, NumPy's OpenBLAS, torch) multiplies at each row class, from one row
(single-stream decode) to a prefill chunk, each pass cycling through copies of the
weights (twice the last-level cache, at most the model's layers) so that they come from
memory as in the model's step. The table is stored for this CPU, torch
version and thread count; the choice is the candidate with the smallest
geometric-mean slowdown over the classes, and the fastest per class is reported
beside it; first, how far ahead the native kernel's lone row tiles fetch their weights
at one row and at 8 (layers/fetch_distance.py), then its decode tiles against its wide
tile at 8 rows, the wide tile at its measured distance (layers/product_table.py).
`--report` prints what is stored (the start-up probe's or a tune's) and plots it, and
what the paged-native backend measured at start-up: the limit of its causal prefill
kernel (attention/prefill_native.py) and its decode kernel's prefetch level
(attention/kv_fetch.py). `--scheduler`
times the scheduler knobs instead (bench/tune_scheduler.py).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from tokenmill.attention import kv_fetch, prefill_native
from tokenmill.bench.tune_scheduler import (
    add_scheduler_arguments,
    cmd_tune_scheduler,
    parse_values,
)
from tokenmill.config import DEFAULT_MODEL_DIR
from tokenmill.layers import fetch_distance, native_linear
from tokenmill.layers.linear import Linear
from tokenmill.layers.product_table import (
    choose,
    cold_copies,
    decode_tiles_path,
    measure,
    measure_decode_tiles,
    read_decode_tiles,
    read_table,
    table_path,
    write_decode_tiles,
    write_table,
)
from tokenmill.layers.row_slices import last_level_cache_bytes
from tokenmill.model.loader import read_config
from tokenmill.model.registry import resolve_model_class

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def model_shapes(model_dir: str) -> tuple[list[tuple[int, int]], int, str]:
    """([out, in] of one decoder layer's Linears and the LM head], layers, a shape name):
    a MoE layer contributes its router and the top-k experts a token runs through."""
    arch = read_config(model_dir)
    with torch.device("meta"):
        model = resolve_model_class(arch.architecture)(arch, 1)
    layer, head = [], []
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        expert = _EXPERT.search(name)
        if expert and int(expert.group(1)) >= arch.num_experts_per_tok:
            continue
        shape = (module.out_features, module.in_features)
        if name.startswith("model.layers.0."):
            layer.append(shape)
        elif name == "lm_head":
            head.append(shape)
    shape_name = (f"h{arch.hidden_size}-i{arch.intermediate_size}-L{arch.num_layers}"
                  f"-v{arch.vocab_size}" + (f"-e{arch.num_experts}" if arch.num_experts else ""))
    return layer + head, arch.num_layers, shape_name


def pass_seconds(layer: dict[str, dict[int, float]], head: dict[str, dict[int, float]],
                 layers: int) -> dict[str, dict[int, float]]:
    """A whole model's products: `layers` times one layer's, plus the LM head's."""
    return {c: {n: layers * layer[c][n] + head[c][n] for n in layer[c]} for c in layer}


def cmd_tune(args: argparse.Namespace) -> int:
    threads = args.threads or torch.get_num_threads()
    if threads < 1:
        print(f"error: --threads must be >= 1, got {threads}", file=sys.stderr)
        return 2
    if args.scheduler:
        try:
            shape = model_shapes(args.model)[2]
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return cmd_tune_scheduler(args, threads, shape)
    if args.report:
        return report(threads, args.out)
    try:
        rows = parse_values(args.rows, "--rows")
        shapes, layers, shape_name = model_shapes(args.model)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"tuning {shape_name} ({len(shapes) - 1} products per layer x {layers} layers + "
          f"LM head) at {threads} threads, rows {list(rows)}")
    progress = (lambda line: print("  " + line, flush=True)) if args.verbose else None
    layer_copies, head_copies = (cold_copies(4 * sum(o * i for o, i in part), most)
                                 for part, most in ((shapes[:-1], layers), (shapes[-1:], 4)))
    if native_linear.available():
        # First how far ahead the native kernel's lone row tiles fetch their weights, from
        # memory: at one row, and at 8 on the wide tile (one tile of 8 rows, which takes
        # the several-row distance; the decode tiles split 8 rows and fetch by shares).
        passes = shapes[:-1] * layer_copies + shapes[-1:]
        one = fetch_distance.measure(passes, threads, repeats=args.repeats)
        decode_rows = native_linear.decode_rows()
        native_linear.set_decode_rows(0)
        try:
            many = fetch_distance.measure(passes, threads, repeats=args.repeats,
                                          rows=fetch_distance.MANY_ROWS)
        finally:
            native_linear.set_decode_rows(decode_rows)
        fetch = fetch_distance.write(threads, one, shape_name, many)
        fetch_distance.configure(threads)
        print(fetch_distance.format_entry(fetch))
        print(f"stored in {fetch_distance.table_path(threads)}")
    if native_linear.available() and native_linear.max_decode_rows() > 0:
        # Then its tiles at a decode step's rows (one layer's products and the head:
        # beyond the caches on most hosts), the wide tile at its measured distance; then
        # native runs with them.
        tiles = write_decode_tiles(threads, measure_decode_tiles(shapes, threads), "tune")
        native_linear.set_decode_rows(tiles["decode_rows"])
        print(format_decode_tiles(tiles))
        print(f"stored in {decode_tiles_path(threads)}")
    # The weights from memory, as in the model's decode step (one layer's weights can sit
    # in a large last-level cache: on a host with 480 MB of it, one layer's products
    # timed 1.4x faster than the same products in a pass over the whole model). The LM
    # head, one matrix, takes up to 4 copies: enough to leave any cache measured so far.
    print(f"each pass through {layer_copies} copies of a layer's weights and {head_copies} "
          f"of the LM head's (beyond the {last_level_cache_bytes() / 2**20:.0f} MB "
          "last-level cache)")
    layer = measure(shapes[:-1], rows, threads, args.repeats, progress=progress,
                    copies=layer_copies)
    head = measure(shapes[-1:], rows, threads, args.repeats, progress=progress,
                   copies=head_copies)
    seconds = pass_seconds(layer, head, layers)
    entry = {"source": "tune", "model": str(args.model), "shape": shape_name,
             "threads": threads, "choice": choose(seconds), "seconds": seconds}
    write_table(threads, entry)
    print(format_table(entry))
    print(f"stored in {table_path(threads)}: --cpu-blas auto takes {entry['choice']} here")
    if args.out:
        plot(entry, args.out)
    return 0


def format_decode_tiles(entry: dict) -> str:
    """The native kernel's decode tiles against its wide tile (layers/product_table.py)."""
    seconds = {int(k): v for k, v in entry["seconds"].items()}
    limit = max(seconds)
    chosen = entry["decode_rows"]
    return (f"native decode tiles ({entry['source']}, {entry['rows']} rows): up to {limit} "
            f"rows {seconds[limit] * 1e3:.2f} ms, wide tile {seconds[0] * 1e3:.2f} ms per "
            f"pass -> " + (f"decode tiles up to {chosen} rows" if chosen else "wide tile"))


def _seconds(entry: dict) -> dict[str, dict[int, float]]:
    """Row counts as integers (a stored table has them as JSON strings)."""
    return {c: {int(n): s for n, s in times.items()} for c, times in entry["seconds"].items()}


def format_table(entry: dict) -> str:
    seconds = _seconds(entry)
    candidates = list(seconds)
    rows = sorted(next(iter(seconds.values())))
    lines = [f"{entry['source']}: {entry.get('shape', 'probe weights')}, {entry['threads']} "
             f"threads; ms per pass of the products (fastest per row class marked *)",
             "| rows | " + " | ".join(candidates) + " | fastest |",
             "| --- | " + " | ".join("---" for _ in candidates) + " | --- |"]
    for n in rows:
        best = min(candidates, key=lambda c: seconds[c][n])
        cells = [f"{seconds[c][n] * 1e3:.2f}" + ("*" if c == best else "") for c in candidates]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {best} |")
    lines.append(f"choice (smallest geometric-mean slowdown): {entry['choice']}")
    return "\n".join(lines)


def report(threads: int, out: Path | None) -> int:
    entry = read_table(threads)
    prefill = prefill_native.stored_tables(threads)
    tiles = read_decode_tiles(threads)
    fetch = fetch_distance.read(threads) if native_linear.available() else None
    kv = kv_fetch.stored(threads)
    if entry is None and not prefill and tiles is None and not kv:
        print(f"nothing measured on this host at {threads} threads yet: run `tokenmill tune` "
              f"(or start an engine: --cpu-blas auto probes)", file=sys.stderr)
        return 1
    if entry is not None:
        print(format_table(entry))
        print(f"from {table_path(threads)}")
        if out:
            plot(entry, out)
    if tiles is not None:
        print(format_decode_tiles(tiles))
        print(f"from {decode_tiles_path(threads)}")
    if fetch is not None:
        print(fetch_distance.format_entry(fetch))
        print(f"from {fetch_distance.table_path(threads)}")
    # The attention backend's own measured choice (paged-native, at engine start-up).
    for geometry, table in prefill.items():
        print("\n" + prefill_native.format_table(geometry, table))
    if prefill:
        print(f"from {prefill_native.table_dir(threads)}")
    for name, measured in kv.items():
        print("\n" + kv_fetch.format_entry(name, measured))
    return 0


def plot(entry: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(6, 4))
    for candidate, times in _seconds(entry).items():
        rows = sorted(times)
        axes.plot(rows, [times[n] * 1e3 / n for n in rows], marker="o", label=candidate)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("rows per product")
    axes.set_ylabel("ms per row, whole pass")
    axes.set_title(f"{entry.get('shape', 'probe')}, {entry['threads']} threads: "
                   f"auto = {entry['choice']}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(out / "tune.png", dpi=110)
    print(f"wrote {out / 'tune.png'}")


def add_tune_subcommand(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser("tune", help="measure this machine's fastest product path for a "
                                       "model; --cpu-blas auto then takes it")
    tune.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    tune.add_argument("--threads", type=int, default=None, help="default: torch's")
    tune.add_argument("--rows", default="1,8,32,128,512", help="row classes to time")
    tune.add_argument("--repeats", type=int, default=5)
    tune.add_argument("--report", action="store_true",
                      help="print (and with --out plot) what is stored for this host")
    tune.add_argument("--out", type=Path, default=None, help="folder for tune.png")
    tune.add_argument("--verbose", action="store_true")
    tune.add_argument("--log-level", default="warning")
    add_scheduler_arguments(tune)
    tune.set_defaults(func=cmd_tune)
