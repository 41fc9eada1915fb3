"""Accuracy vs thinking budget on the embedded reasoning model (issue 19).

Held-out items of the task family (tokenmill/train/reasoning_tasks.py, --per-level items
of each level, a seed no training run used) are asked through the chat template,
greedy, once per thinking budget (--budgets; "none" = unlimited) and per bridge
(--bridges: "model" = the model's declared bridge, a newline for pyreason; "cut" = the
end marker alone, a hard cut). Per (bridge, budget) the script reports accuracy per
level and overall, mean thinking tokens and mean output tokens per request, and the
wall time of the whole batch (all items submitted at once; median of --repeats runs,
interleaved across budgets, so a busy machine slows every budget alike).

Then the same sweep runs again on an engine with n-gram speculative decoding (prefix
caching is on in both: every budget after the first re-reads the prompts' cached
blocks) and must give the same tokens for every item and budget, with the KV pool
whole afterwards.

    python benchmarks/bench_reasoning.py [--model models/pyreason] [--per-level 50]
        [--budgets 0,8,16,24,32,48,64,96,none] [--plot docs/reasoning_budget.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.train.reasoning_eval import (  # noqa: E402
    ask,
    check,
    eval_items,
    greedy_params,
    summarize,
)
from tokenmill.train.reasoning_tasks import LEVELS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BRIDGES = {"model": None, "cut": ""}


def params_for(budget: int | None, bridge: str) -> SamplingParams:
    return greedy_params(thinking_budget=budget, thinking_bridge=BRIDGES[bridge])


def sweep(llm: LLM, items, budgets, bridges, repeats: int) -> dict:
    """{(bridge, budget): (results, token ids, wall seconds of each repeat)}."""
    runs: dict = {}
    for _ in range(repeats):
        for bridge in bridges:
            for budget in budgets:
                started = time.perf_counter()
                outputs = ask(llm, items, params_for(budget, bridge))
                wall = time.perf_counter() - started
                key = (bridge, budget)
                if key not in runs:
                    runs[key] = (check(items, outputs),
                                 [o.outputs[0].token_ids for o in outputs], [])
                runs[key][2].append(wall)
    return runs


def table(runs: dict, budgets, bridges) -> list[dict]:
    rows = []
    for bridge in bridges:
        for budget in budgets:
            results, _, walls = runs[(bridge, budget)]
            summary = {s.level: s for s in summarize(results)}
            rows.append({
                "bridge": bridge, "budget": budget,
                "accuracy": {str(level): summary[level].accuracy for level in LEVELS},
                "accuracy_all": summary[None].accuracy,
                "mean_thinking": summary[None].mean_thinking,
                "mean_output_tokens": summary[None].mean_output_tokens,
                "answered": sum(r.answered for r in results) / len(results),
                "wall_s": statistics.median(walls),
            })
    return rows


def print_table(rows: list[dict]) -> None:
    levels = " | ".join(f"L{level}" for level in LEVELS)
    print(f"| bridge | budget | {levels} | all | thinking tok | output tok | answered | "
          "batch wall s | output tok/s |")
    print("| --- " * (len(LEVELS) + 8) + "|")
    for row in rows:
        accuracy = " | ".join(f"{row['accuracy'][str(level)]:.0%}" for level in LEVELS)
        total_tokens = row["mean_output_tokens"] * row["items"]
        print(f"| {row['bridge']} | {row['budget'] if row['budget'] is not None else 'none'} | "
              f"{accuracy} | {row['accuracy_all']:.1%} | {row['mean_thinking']:.1f} | "
              f"{row['mean_output_tokens']:.1f} | {row['answered']:.0%} | "
              f"{row['wall_s']:.2f} | {total_tokens / row['wall_s']:.0f} |")


def plot(rows: list[dict], budgets, path: Path) -> None:
    finite = [b for b in budgets if b is not None]
    unlimited_x = (max(finite) * 1.25) if finite else 1
    xs = [b if b is not None else unlimited_x for b in budgets]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    for level in LEVELS:
        for bridge, style in (("model", "-o"), ("cut", ":x")):
            ys = [r["accuracy"][str(level)] for r in rows if r["bridge"] == bridge]
            if ys:
                left.plot(xs, ys, style, color=f"C{level - 1}", markersize=4,
                          label=f"level {level}" if bridge == "model" else None)
    for bridge, style in (("model", "-o"), ("cut", ":x")):
        ys = [r["mean_output_tokens"] for r in rows if r["bridge"] == bridge]
        if ys:
            right.plot(xs, ys, style, color="k", label=f"bridge: {bridge}")
    for axes in (left, right):
        axes.set_xticks(xs, [str(b) if b is not None else "none" for b in budgets])
        axes.set_xlabel("thinking budget (tokens)")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    left.set_ylabel("accuracy (greedy; solid: newline bridge, dotted: hard cut)")
    right.set_ylabel("mean output tokens per request")
    left.set_title("pyreason: accuracy vs thinking budget")
    right.set_title("tokens per request")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def check_speculation(model: str, items, budgets, bridges, reference: dict) -> str:
    """The same sweep with n-gram speculation: identical tokens, KV pool whole."""
    llm = LLM(model, progress=False, num_threads=2, max_num_seqs=256, speculative_method="ngram",
              spec_adaptive=False)
    runs = sweep(llm, items, budgets, bridges, repeats=1)
    differing = [key for key, (_, tokens, _) in runs.items() if tokens != reference[key][1]]
    kv = llm.engine.kv_manager
    stats = llm.engine.stats
    return (f"n-gram speculation + prefix caching: {len(runs)} (bridge, budget) sweeps, "
            f"{sum(len(t) for _, t, _ in runs.values())} requests, token-identical: "
            f"{not differing} {differing or ''}; drafted {stats.spec_draft_tokens}, accepted "
            f"{stats.spec_accepted_tokens}; prefix-cache hits {kv.prefix_hits} tokens; "
            f"free blocks after {kv.num_free_blocks}/{kv.num_blocks}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "pyreason"))
    parser.add_argument("--per-level", type=int, default=50)
    parser.add_argument("--budgets", default="0,8,16,24,32,48,64,96,none")
    parser.add_argument("--bridges", default="model,cut")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--no-speculation-check", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    budgets = [None if b == "none" else int(b) for b in args.budgets.split(",")]
    bridges = args.bridges.split(",")
    items = eval_items(args.per_level)
    llm = LLM(args.model, progress=False, num_threads=args.threads, max_num_seqs=256)
    ask(llm, items[:8], greedy_params())  # warm-up
    runs = sweep(llm, items, budgets, bridges, args.repeats)
    rows = table(runs, budgets, bridges)
    for row in rows:
        row["items"] = len(items)
    print(f"{len(items)} held-out items ({args.per_level} per level), greedy, "
          f"{args.threads} threads; wall times: median of {args.repeats} interleaved runs")
    print_table(rows)
    if args.plot is not None:
        plot(rows, budgets, args.plot)
    if not args.no_speculation_check:
        print(check_speculation(args.model, items, budgets, bridges, runs))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
