"""`tokenmill bench moe`: how evenly a mixture-of-experts model spreads a workload over
its experts.

Runs the workload (after a warm-up that is not counted) and reports, per MoE layer,
the tokens routed, the imbalance (busiest expert over the mean expert: what an
expert-parallel step would wait for, relative to perfect balance), the hottest
expert and its share, with a heat map of every layer's expert shares.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenmill.bench.driver import run_engine_workload, warm_up
from tokenmill.core.expert_load import ExpertLoad, imbalance


def expert_report(totals: list[list[int]]) -> list[dict]:
    rows = []
    for layer, counts in enumerate(totals):
        total = sum(counts)
        hottest = max(range(len(counts)), key=counts.__getitem__)
        rows.append({"layer": layer, "tokens": total, "imbalance": imbalance(counts),
                     "hottest_expert": hottest,
                     "hottest_share": counts[hottest] / total if total else 0.0,
                     "counts": counts})
    return rows


def plot_heat_map(totals: list[list[int]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = [[c / max(sum(layer), 1) for c in layer] for layer in totals]
    figure, axes = plt.subplots(figsize=(2.5 + 0.5 * len(shares[0]), 1.2 + 0.35 * len(shares)))
    image = axes.imshow(shares, aspect="auto", cmap="viridis")
    axes.set_xlabel("expert")
    axes.set_ylabel("MoE layer")
    axes.set_title(title)
    figure.colorbar(image, label="share of the layer's routed tokens")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def cmd_bench_moe(args: argparse.Namespace) -> int:
    from tokenmill.bench.throughput import load_engine_and_workload

    try:
        engine, workload, _ = load_engine_and_workload(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if not engine.arch.num_experts:
            print(f"error: {engine.config.model.model} is not a mixture of experts",
                  file=sys.stderr)
            return 2
        warm_up(engine)
        window = engine.config.parallel.expert_stats_window_s
        engine.expert_load, engine.rank_load = ExpertLoad(window), ExpertLoad(window)
        engine.expert_moves, engine.expert_rebalance_s = 0, 0.0
        run = run_engine_workload(engine, workload, args.max_concurrency, desc="moe")
    finally:
        engine.shutdown()
    rows = expert_report(engine.expert_load.totals)
    output_tokens = sum(r.output_tokens for r in run.records)
    print(f"{engine.config.model.model}: {len(workload)} requests, {run.num_steps} steps, "
          f"{output_tokens / run.duration_s:.1f} output tokens/s; top-"
          f"{engine.arch.num_experts_per_tok} of {engine.arch.num_experts} experts")
    print("| MoE layer | tokens routed | imbalance (max/mean) | hottest expert | its share |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['layer']} | {row['tokens']} | {row['imbalance']:.2f} | "
              f"{row['hottest_expert']} | {row['hottest_share']:.1%} |")
    worst = max(rows, key=lambda r: r["imbalance"])
    print(f"mean imbalance {sum(r['imbalance'] for r in rows) / len(rows):.2f}; worst layer "
          f"{worst['layer']} at {worst['imbalance']:.2f}: an expert-parallel step there "
          f"would take {worst['imbalance']:.2f}x a balanced one")
    ranks = engine.rank_load.totals
    if ranks:  # replicated experts: the balance over ranks they bought
        print("ranks' (token, expert) pairs per layer, busiest over mean: " + ", ".join(
            f"{imbalance(layer):.2f}" for layer in ranks) + f"; {engine.expert_moves} "
            f"expert copies moved in {engine.expert_rebalance_s:.2f} s of re-planning")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe.json").write_text(json.dumps(
            {"model": str(engine.config.model.model), "duration_s": run.duration_s,
             "output_tokens": output_tokens, "layers": rows}, indent=1))
        plot_heat_map(engine.expert_load.totals, args.out / "moe.png",
                      f"{Path(engine.config.model.model).name}: expert load")
        print(f"wrote {args.out / 'moe.json'} and {args.out / 'moe.png'}")
    return 0


def add_moe_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.arguments import add_engine_arguments
    from tokenmill.bench.workload import add_workload_arguments

    parser.add_argument("--out", type=Path, default=None,
                        help="folder for moe.json and the heat map moe.png")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--no-roofline", action="store_true", default=True,
                        help=argparse.SUPPRESS)
    parser.add_argument("--log-level", default="warning")
    add_workload_arguments(parser)
    add_engine_arguments(parser)
    parser.set_defaults(func=cmd_bench_moe)
