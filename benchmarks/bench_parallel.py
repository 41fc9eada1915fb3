"""TP=1 vs TP=2 (with and without sequence parallelism) vs PP=2 on this machine, each
run's time split into compute / communication / host, and the planner's prediction of
each layout's model time (compute + communication) beside what was measured.

Every rank runs 1 thread, so TP=2 and PP=2 use both of a 2-core machine's cores; TP=1
is shown at 1 thread (the same per-rank budget) and at 2 (the same machine). Run on a
quiet machine, after `tokenmill bench collectives` (the planner's link fit):

    python benchmarks/bench_parallel.py --model models/pycoder --json par.json --plot par.png
    python benchmarks/bench_parallel.py --model 0.5b --json par05.json --plot par05.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenmill.bench.driver import run_engine_workload, warm_up
from tokenmill.bench.workload import WorkloadRequest
from tokenmill.engine.engine import LLMEngine
from tokenmill.model.loader import read_config
from tokenmill.plan.clusters import calibrated_local, measure_local_device
from tokenmill.plan.parallel import Layout, Workload, estimate
from tokenmill.profile.summary import summarize_steps
from tokenmill.profile.tracer import StepTracer

LAYOUTS = {
    "tp1-1t": dict(num_threads=1),
    "tp1-2t": dict(num_threads=2),
    "tp2": dict(num_threads=1, tensor_parallel_size=2),
    "tp2-sp": dict(num_threads=1, tensor_parallel_size=2, sequence_parallel=True),
    "pp2": dict(num_threads=1, pipeline_parallel_size=2),
    "pp2-mb1": dict(num_threads=1, pipeline_parallel_size=2, pipeline_micro_batches=1),
}


def requests(vocab: int, count: int, prompt: int, output: int) -> list[WorkloadRequest]:
    return [WorkloadRequest([1 + (r * 131 + i * 7919) % (vocab - 1) for i in range(prompt)],
                            prompt, output) for r in range(count)]


def run_layout(model: str, options: dict, workloads: dict) -> dict:
    engine = LLMEngine.from_kwargs(model, progress=False, max_model_len=1024,
                                   max_num_batched_tokens=4096, **options)
    results = {}
    try:
        warm_up(engine)
        for name, (count, prompt, output) in workloads.items():
            work = requests(engine.arch.vocab_size, count, prompt, output)
            tracer = StepTracer().attach(engine)
            try:
                run = run_engine_workload(engine, work, progress=False, desc=name)
            finally:
                tracer.detach(engine)
            summary = summarize_steps(tracer.steps)
            tokens = count * (prompt if name == "prefill" else output)
            results[name] = {"tokens_per_s": tokens / run.duration_s, "wall_s": run.duration_s,
                             "steps": summary.num_steps, "compute_s": summary.compute_s,
                             "communication_s": summary.communication_s,
                             "host_s": summary.host_s, "idle_s": summary.idle_s}
    finally:
        engine.shutdown()
    return results


def predictions(model: str, layouts: list[str], workloads: dict) -> dict:
    """The planner's model time per layout and workload on this machine, fp32, with
    the measured GEMM rate as the device's peak (efficiency 1)."""
    cluster = calibrated_local(*measure_local_device())
    if cluster is None:
        print("no collectives fit here: run `tokenmill bench collectives` first",
              file=sys.stderr)
        return {}
    arch = read_config(model)
    out = {}
    for name in layouts:
        options = LAYOUTS[name]
        if options.get("num_threads") != 1 or options.get("sequence_parallel"):
            continue  # the planner models one thread per rank, without SP
        tp, pp = options.get("tensor_parallel_size", 1), options.get("pipeline_parallel_size", 1)
        micro = options.get("pipeline_micro_batches", pp)
        layout = Layout(tp, pp)
        out[name] = {}
        for work, (count, prompt, output) in workloads.items():
            if work == "prefill":
                seconds = estimate(arch, cluster, layout, Workload(
                    "prefill", count, prompt, prompt // 2, micro), 1.0, 4).step_s
            else:
                seconds = output * estimate(arch, cluster, layout, Workload(
                    "decode", count, 1, prompt + output // 2, micro), 1.0, 4).step_s
            out[name][work] = seconds
    return out


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    works = list(next(iter(results.values())))
    figure, axes = plt.subplots(1, len(works), figsize=(6 * len(works), 4))
    for ax, work in zip(axes, works, strict=True):
        names = list(results)
        bottom = [0.0] * len(names)
        for part, color in (("compute_s", "tab:blue"), ("communication_s", "tab:red"),
                            ("host_s", "tab:gray"), ("idle_s", "tab:olive")):
            values = [results[n][work][part] for n in names]
            ax.bar(names, values, bottom=bottom, color=color, label=part.removesuffix("_s"))
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_title(f"{title}: {work}")
        ax.set_ylabel("seconds")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/pycoder",
                        help="a model directory, or 0.5b: the random Qwen2.5-0.5B shape")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    model = args.model
    if model == "0.5b":
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_core import build_model

        path = Path.home() / ".cache" / "tokenmill" / "models" / "qwen2.5-0.5b-random"
        build_model(path)
        model = str(path)
    layouts = args.layouts.split(",")
    # prefill: every prompt in one go, one token out; decode: short prompts, many steps.
    workloads = {"prefill": (args.requests, args.prompt, 1),
                 "decode": (args.requests, 16, args.output)}
    results = {}
    for name in layouts:
        print(f"--- {name}", file=sys.stderr, flush=True)
        results[name] = run_layout(model, LAYOUTS[name], workloads)
    predicted = predictions(model, layouts, workloads)
    base = results[layouts[0]]
    print(f"model {args.model}; {args.requests} requests; prefill {args.prompt} tokens each, "
          f"decode {args.output} tokens each after 16; ratios against {layouts[0]}")
    print("| layout | workload | tokens/s | vs base | compute s | comm s | host s | "
          "predicted model s | measured model s | error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in layouts:
        for work, row in results[name].items():
            measured = row["compute_s"] + row["communication_s"]
            guess = predicted.get(name, {}).get(work)
            cells = ("-", "-") if guess is None else (f"{guess:.2f}",
                                                      f"{(guess - measured) / measured:+.0%}")
            print(f"| {name} | {work} | {row['tokens_per_s']:.1f} | "
                  f"{row['tokens_per_s'] / base[work]['tokens_per_s']:.2f}x | "
                  f"{row['compute_s']:.2f} | {row['communication_s']:.2f} | {row['host_s']:.2f} "
                  f"| {cells[0]} | {measured:.2f} | {cells[1]} |")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "predicted": predicted},
                                        indent=1))
    if args.plot:
        plot(results, args.plot, Path(args.model).name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
