"""Early exit on the embedded reasoning model: accuracy, exit rate and speed against the
confidence threshold, at each exit layer (issue 19).

Held-out items (--per-level of each level) are asked greedily through the chat
template. Per (exit layer, threshold): accuracy overall and at the hardest level, the
share of decode tokens that exited, and output tokens/s two ways: every item at once
(batched: a step saves time only when all its tokens exit) and one item at a time
(single stream, --stream items: each exit skips the later layers' attention and MLP).
The plain engine (no exit test) is the baseline, measured in the same run; threshold 1.0
never exits but pays for the exit test.

    python benchmarks/bench_early_exit.py [--layers 2,3] [--thresholds 1.0,0.99,0.95,0.9,0.8]
        [--per-level 30] [--stream 12] [--threads 2] [--json ee.json] [--plot ee.png]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.train.reasoning_eval import ask, check, eval_items, summarize

ROOT = Path(__file__).resolve().parent.parent


def measure(model: str, layer: int | None, threshold: float, items, stream: int) -> dict:
    """layer None: the plain engine (no exit test at all), the baseline."""
    options = {} if layer is None else {"early_exit_layer": layer,
                                        "early_exit_threshold": threshold}
    llm = LLM(model, progress=False, **options)
    params = SamplingParams(temperature=0, max_tokens=256)
    ask(llm, items[:2], params)  # warm-up
    counts = llm.engine.executor.worker.runner.early_exit
    if counts is not None:
        counts.tokens = counts.exited = counts.whole_steps = 0
    started = time.perf_counter()
    outputs = ask(llm, items, params)
    batch_s = time.perf_counter() - started
    results = check(items, outputs)
    batch_tokens = sum(r.output_tokens for r in results)
    exit_rate = counts.exited / max(counts.tokens, 1) if counts is not None else 0.0
    chosen = items[::max(1, len(items) // stream)][:stream]
    started = time.perf_counter()
    stream_tokens = sum(len(ask(llm, [item], params)[0].outputs[0].token_ids)
                        for item in chosen)
    stream_s = time.perf_counter() - started
    rows = summarize(results)
    return {"layer": layer, "threshold": threshold, "accuracy": rows[-1].accuracy,
            "hardest_level_accuracy": rows[-2].accuracy, "exit_rate": exit_rate,
            "batch_tokens_per_s": batch_tokens / batch_s,
            "stream_tokens_per_s": stream_tokens / stream_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "pyreason"))
    parser.add_argument("--layers", default="2,3")
    parser.add_argument("--thresholds", default="1.0,0.99,0.95,0.9,0.8")
    parser.add_argument("--per-level", type=int, default=30)
    parser.add_argument("--stream", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    items = eval_items(args.per_level)
    plain = measure(args.model, None, 1.0, items, args.stream)
    rows = [plain] + [measure(args.model, int(layer), float(t), items, args.stream)
                      for layer in args.layers.split(",") for t in args.thresholds.split(",")]
    print(f"{args.model}: {len(items)} held-out items, greedy; threads {args.threads}")
    print("| exit layer | threshold | accuracy | level 6 | tokens exited | batch tok/s | "
          "vs plain | single-stream tok/s | vs plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['layer'] or 'off'} | {row['threshold']:g} | {row['accuracy']:.1%} | "
              f"{row['hardest_level_accuracy']:.1%} | {row['exit_rate']:.1%} | "
              f"{row['batch_tokens_per_s']:.0f} | "
              f"{row['batch_tokens_per_s'] / plain['batch_tokens_per_s']:.2f}x | "
              f"{row['stream_tokens_per_s']:.0f} | "
              f"{row['stream_tokens_per_s'] / plain['stream_tokens_per_s']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(6, 4))
        for layer in sorted({r["layer"] for r in rows if r["layer"]}):
            mine = [r for r in rows if r["layer"] == layer]
            axes.plot([r["stream_tokens_per_s"] / plain["stream_tokens_per_s"] for r in mine],
                      [r["accuracy"] for r in mine], marker="o", label=f"exit after layer {layer}")
            for r in mine:
                axes.annotate(f"{r['threshold']:g}", (r["stream_tokens_per_s"]
                                                      / plain["stream_tokens_per_s"],
                                                      r["accuracy"]), fontsize=7)
        axes.scatter([1.0], [plain["accuracy"]], color="black", label="no early exit")
        axes.set_xlabel("single-stream speed vs plain")
        axes.set_ylabel("accuracy")
        axes.legend()
        figure.tight_layout()
        figure.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
