"""Hot-expert replication, measured for real: pycoder-moe over 2 worker processes with
expert parallelism, without replicas and with replicas under each routing policy and
re-planning window (issue 20).

Per configuration, on the same code workload after a warm-up: output tokens/s, mean
step time, the experts' imbalance (busiest over mean expert, the router's doing) and the
ranks' imbalance (busiest over mean rank's (token, expert) pairs: what a step waits
for, and what replicas change), the copies moved and the seconds re-planning took.
Without replicas the ranks' load follows from the experts' (contiguous blocks).

`--widen N` also runs a copy of the model whose experts are N times wider, the extra
rows and columns zero: the same routing and the same output, but expert compute a
realistic share of the step (pycoder-moe's 256-wide experts are a sliver of it).

    python benchmarks/bench_moe_replicas.py [--requests 32] [--input-len 128]
        [--output-len 32] [--redundant 2] [--widen 16] [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenmill.bench.driver import run_engine_workload, warm_up
from tokenmill.bench.workload import WorkloadSpec, build_workload
from tokenmill.core.expert_load import ExpertLoad, imbalance
from tokenmill.engine.engine import LLMEngine

ROOT = Path(__file__).resolve().parent.parent
EXPERT = ".block_sparse_moe.experts."


def configs(redundant: int) -> list[tuple[str, dict]]:
    replicas = {"expert_redundant_slots": redundant}
    return [
        ("EP, no replicas", {}),
        ("replicas planned once (uniform), round-robin",
         {**replicas, "expert_routing": "round_robin", "expert_balance_window_s": float("inf")}),
        *[(f"replicas, {policy}, window 100 ms",
           {**replicas, "expert_routing": policy, "expert_balance_window_s": 0.1})
          for policy in ("round_robin", "least_loaded", "locality")],
        *[(f"replicas, least_loaded, window {label}",
           {**replicas, "expert_routing": "least_loaded", "expert_balance_window_s": window})
          for label, window in (("every step", 0.0), ("1 s", 1.0))],
        ("replicas, least_loaded, window 100 ms, re-plan gain >= 20%",
         {**replicas, "expert_routing": "least_loaded", "expert_balance_window_s": 0.1,
          "expert_replan_min_gain": 0.2}),
    ]


def widened(model: Path, factor: int, out: Path) -> Path:
    """A copy of `model` whose experts are `factor` x wider with zero weights added."""
    shutil.copytree(model, out, dirs_exist_ok=True)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in list(tensors.items()):
            if EXPERT not in name:
                continue
            if name.endswith(("w1.weight", "w3.weight")):  # [I, H]: more rows
                grown = tensor.new_zeros(tensor.shape[0] * factor, tensor.shape[1])
                grown[:tensor.shape[0]] = tensor
            else:  # w2 [H, I]: more columns
                grown = tensor.new_zeros(tensor.shape[0], tensor.shape[1] * factor)
                grown[:, :tensor.shape[1]] = tensor
            tensors[name] = grown
        save_file(tensors, path)
    config = json.loads((out / "config.json").read_text())
    config["intermediate_size"] *= factor
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def measure(model: str, options: dict, spec: WorkloadSpec) -> dict:
    engine = LLMEngine.from_kwargs(model, progress=False, tensor_parallel_size=2,
                                   expert_parallel=True, sequence_parallel=True, **options)
    try:
        workload = build_workload(spec, engine.arch.vocab_size, engine.tokenizer,
                                  engine.eos_token_ids)
        warm_up(engine)
        window = engine.config.parallel.expert_stats_window_s
        engine.expert_load, engine.rank_load = ExpertLoad(window), ExpertLoad(window)
        engine.expert_moves, engine.expert_rebalance_s = 0, 0.0
        run = run_engine_workload(engine, workload, progress=False)
        experts = engine.expert_load.totals
        ranks = engine.rank_load.totals or [
            [sum(layer[:len(layer) // 2]), sum(layer[len(layer) // 2:])] for layer in experts]
    finally:
        engine.shutdown()
    output = sum(r.output_tokens for r in run.records)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return {"tokens_per_s": output / run.duration_s,
            "step_ms": run.duration_s / run.num_steps * 1e3,
            "expert_imbalance": mean([imbalance(layer) for layer in experts]),
            "rank_imbalance": mean([imbalance(layer) for layer in ranks]),
            "worst_rank_imbalance": max(imbalance(layer) for layer in ranks),
            "moves": engine.expert_moves, "rebalance_s": engine.expert_rebalance_s,
            "duration_s": run.duration_s}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 0.6 * len(next(iter(results.values()))) + 2))
    for index, (model, rows) in enumerate(results.items()):
        names = [row["config"] for row in rows]
        offset = [i + 0.4 * index for i in range(len(rows))]
        axes[0].barh(offset, [r["rank_imbalance"] for r in rows], height=0.4, label=model)
        axes[1].barh(offset, [r["tokens_per_s"] for r in rows], height=0.4, label=model)
    for ax, label in zip(axes, ("ranks' imbalance (busiest / mean; 1 = balanced)",
                                "output tokens/s"), strict=True):
        ax.set_yticks([i + 0.2 for i in range(len(names))])
        ax.set_yticklabels(names if ax is axes[0] else [])
        ax.set_xlabel(label)
        ax.invert_yaxis()
    axes[1].legend()
    figure.suptitle("expert parallelism over 2 processes: replicas and routing")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "pycoder-moe"))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--redundant", type=int, default=2)
    parser.add_argument("--widen", type=int, default=0, help="also run N x wider experts")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    spec = WorkloadSpec(source="code", num_requests=args.requests, input_len=args.input_len,
                        output_len=args.output_len)
    models = {Path(args.model).name: args.model}
    scratch = tempfile.TemporaryDirectory()
    if args.widen:
        wide = widened(Path(args.model), args.widen, Path(scratch.name) / "wide")
        models[f"{Path(args.model).name}, experts x{args.widen}"] = str(wide)
    print(f"host: {torch.get_num_threads()} threads; {args.requests} code requests of "
          f"{args.input_len} + {args.output_len} tokens; 2 ranks, expert + sequence parallel")
    results: dict[str, list[dict]] = {}
    for label, model in models.items():
        print(f"\n{label}\n| configuration | out tok/s | step ms | experts' imbalance | "
              "ranks' imbalance (worst layer) | copies moved | re-planning s |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        results[label] = []
        for name, options in configs(args.redundant):
            row = {"config": name, **measure(model, options, spec)}
            results[label].append(row)
            print(f"| {name} | {row['tokens_per_s']:.1f} | {row['step_ms']:.1f} | "
                  f"{row['expert_imbalance']:.2f} | {row['rank_imbalance']:.2f} "
                  f"({row['worst_rank_imbalance']:.2f}) | {row['moves']} | "
                  f"{row['rebalance_s']:.2f} |", flush=True)
    scratch.cleanup()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
