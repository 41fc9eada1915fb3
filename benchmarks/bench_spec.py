"""Speculative decoding on the embedded model: none vs n-gram vs draft vs EAGLE.

Workload: Python-completion prompts cut from the held-out stdlib files (never seen
in training): --prompts windows of --prompt-tokens tokens at seeded random offsets,
files taken round-robin, --max-tokens greedy new tokens each (EOS ignored, so
every configuration does the same work). Each batch size b runs the whole set with
at most b requests in flight (b = 1 is single-stream). With --vary-lengths each
request asks for its own seeded length instead: with equal lengths, the requests of
a batch start, prefill and finish together when nothing speculates, and apart when
something does, which costs the speculating engine batch occupancy that serving
traffic (lengths differ) would not give the baseline either.

Configurations, one engine each, all measured in the same run and interleaved
(repetition-major): no speculation (the baseline of every ratio), a second engine
without speculation (the control: its ratio is this run's noise floor between two
identical configurations), and each method with the adaptive switch on (the
default) and off (always k tokens). Engines live through the whole run, as a server
would: the adaptive switch learns in an engine's first run at a batch size, which
the 'first run' column shows apart.

    python benchmarks/bench_spec.py [--model models/pycoder] [--threads 2]
        [--batches 1 8 32] [--prompts 32] [--repeats 3] [--repeats-batched 7]

Prints a Markdown table (output tokens/s, ratio to no speculation: the median of
the repetitions' paired ratios and the first repetition's, acceptance rate, engine
steps) per batch size, writes JSON and a plot of the speedup per batch size and the
acceptance by draft position.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
from pathlib import Path

import torch

from tokenmill.bench.driver import run_engine_workload, warm_up
from tokenmill.bench.workload import WorkloadRequest
from tokenmill.engine.engine import LLMEngine
from tokenmill.speculative.registry import SPECULATIVE_METHODS
from tokenmill.train.corpus import held_out_texts

ROOT = Path(__file__).resolve().parent.parent


def build_prompts(engine: LLMEngine, count: int, prompt_tokens: int, max_tokens: int,
                  seed: int, vary_lengths: bool = False) -> list[WorkloadRequest]:
    """Prompts from the held-out files, each starting at a random line; files are
    taken round-robin (several windows per file when there are fewer files than
    prompts). With vary_lengths, request i asks for a seeded U[max/2, 3 max/2] tokens
    instead of max_tokens (same total on average)."""
    rng = random.Random(seed)
    files = [engine.encode(t) for t in held_out_texts()]
    files = [ids for ids in files if len(ids) >= prompt_tokens + 8]
    if not files:
        raise SystemExit(f"no held-out file has {prompt_tokens} tokens")
    rng.shuffle(files)
    prompts = []
    for index in range(count):
        ids = files[index % len(files)]
        start = rng.randrange(len(ids) - prompt_tokens)
        wanted = (rng.randint(max_tokens // 2, max_tokens * 3 // 2) if vary_lengths
                  else max_tokens)
        prompts.append(WorkloadRequest(ids[start:start + prompt_tokens], prompt_tokens,
                                       wanted))
    return prompts


def configurations(model: str, methods: list[str], k: int) -> list[tuple[str, dict]]:
    configs = [("none", {}), ("none (control)", {})]
    for method in methods:
        options = {"speculative_method": method, "num_speculative_tokens": k}
        path = SPECULATIVE_METHODS[method].model_dir(model, None)
        if path is not None:
            if not (path / "config.json").is_file():
                print(f"skipping {method}: no model at {path}", file=sys.stderr)
                continue
        configs.append((method, options))
        configs.append((f"{method} (fixed k)", {**options, "spec_adaptive": False}))
    return configs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "pycoder"))
    parser.add_argument("--methods", nargs="+", default=["ngram", "draft", "eagle"])
    parser.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--vary-lengths", action="store_true",
                        help="outputs of U[max/2, 3 max/2] tokens per request (seeded), so "
                             "that batched requests do not start and finish in lockstep")
    parser.add_argument("--repeats", type=int, default=3,
                        help="repetitions at batch 1 (runs of several seconds each)")
    parser.add_argument("--repeats-batched", type=int, default=7,
                        help="repetitions at larger batches (runs of 1-2 s, noisier)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "spec")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    configs = configurations(args.model, args.methods, args.k)
    engines = {}
    for name, options in configs:
        engines[name] = LLMEngine.from_kwargs(args.model, progress=False,
                                              max_num_seqs=max(args.batches), **options)
        warm_up(engines[name])
    workload = build_prompts(engines["none"], args.prompts, args.prompt_tokens,
                             args.max_tokens, args.seed, args.vary_lengths)

    runs: dict[tuple[str, int], list] = {}
    for rep in range(max(args.repeats, args.repeats_batched)):
        for batch in args.batches:
            if rep >= (args.repeats if batch == 1 else args.repeats_batched):
                continue
            for name, _ in configs:
                run = run_engine_workload(engines[name], workload, batch, progress=True,
                                          desc=f"{name} b={batch} rep {rep + 1}")
                runs.setdefault((name, batch), []).append(run)
    for engine in engines.values():
        engine.check_integrity()

    results = []
    for batch in args.batches:
        tokens = sum(r.output_tokens for r in runs[("none", batch)][0].records)
        base = [tokens / r.duration_s for r in runs[("none", batch)]]
        for name, _ in configs:
            reps = runs[(name, batch)]
            rates = [tokens / r.duration_s for r in reps]
            # Each repetition's ratio to the baseline run next to it (interleaved), so
            # that the machine's drift between repetitions cancels; the median of those.
            ratios = [rate / b for rate, b in zip(rates, base, strict=True)]
            drafted = sum(r.spec_draft_tokens for r in reps)
            accepted = sum(r.spec_accepted_tokens for r in reps)
            results.append({"config": name, "batch": batch,
                            "out_tok_s": statistics.median(rates),
                            "speedup": statistics.median(ratios),
                            # The engine's first run at this batch size: what learning
                            # that speculation loses here (or not) cost.
                            "first_speedup": ratios[0], "draft_tokens": drafted,
                            "accepted_tokens": accepted,
                            "acceptance": accepted / drafted if drafted else None,
                            "steps": statistics.median(r.num_steps for r in reps)})
    by_position = {name: (engines[name].stats.spec_drafted_by_position,
                          engines[name].stats.spec_accepted_by_position)
                   for name, _ in configs if not name.startswith("none")}
    print_table(results, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_spec.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
         "by_position": by_position}, indent=2))
    plot(results, by_position, args.out / "spec_speedup.png")
    print(f"wrote {args.out / 'bench_spec.json'} and {args.out / 'spec_speedup.png'}")
    return 0


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    lengths = (f"U[{args.max_tokens // 2}, {args.max_tokens * 3 // 2}]" if args.vary_lengths
               else str(args.max_tokens))
    print(f"\n{args.prompts} held-out prompts of {args.prompt_tokens} tokens, "
          f"{lengths} greedy tokens each, k = {args.k}, {args.threads} threads, "
          f"median of {args.repeats} (batch 1) / {args.repeats_batched} (larger) repetitions; "
          f"'vs none': median of each repetition's ratio, 'first run': the first one\n")
    print("| batch | config | out tok/s | vs none | first run | acceptance | engine steps |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        acceptance = "-" if r["acceptance"] is None else f"{r['acceptance']:.1%}"
        print(f"| {r['batch']} | {r['config']} | {r['out_tok_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['first_speedup']:.2f}x | {acceptance} | {r['steps']:.0f} |")


def plot(results: list[dict], by_position: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    configs = list(dict.fromkeys(r["config"] for r in results))
    batches = sorted({r["batch"] for r in results})
    methods = list(dict.fromkeys(name.split(" ")[0] for name in configs))
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    for name in configs:
        points = [next(r["speedup"] for r in results if r["config"] == name and r["batch"] == b)
                  for b in batches]
        style = "--" if "fixed" in name else "-"
        axes[0].plot([str(b) for b in batches], points, style, marker="o", label=name,
                     color=colors[name.split(" ")[0]])
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].set_xlabel("requests in flight")
    axes[0].set_ylabel("output tokens/s vs no speculation")
    axes[0].set_title("Speedup (solid: adaptive, dashed: fixed k)")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    for name, (drafted, accepted) in by_position.items():
        if "fixed" not in name or not drafted:
            continue
        rates = [a / d if d else 0.0 for d, a in zip(drafted, accepted, strict=True)]
        axes[1].plot(range(1, len(rates) + 1), rates, "--", marker="o", label=name,
                     color=colors[name.split(" ")[0]])
    axes[1].set_xlabel("draft position")
    axes[1].set_xticks(range(1, max(len(d) for d, _ in by_position.values()) + 1))
    axes[1].set_ylabel("accepted / drafted")
    axes[1].set_ylim(0, 1.05)
    axes[1].set_title("Acceptance by position (fixed k, all batch sizes)")
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replot(json_path: Path) -> None:
    data = json.loads(json_path.read_text())
    plot(data["results"], data["by_position"], json_path.with_name("spec_speedup.png"))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--replot":  # redraw from a saved JSON
        replot(Path(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
