"""`tokenmill tune --scheduler`: the scheduler knobs that change speed, measured on this
machine for the model being served: the step token budget (`--max-num-batched-tokens`,
which also bounds a prefill chunk), the KV block size (`--block-size`) and, where asked
(`--attention-backends paged,paged-native`), the attention backend.

Each setting serves the same offline workload (`--num-requests` random prompts of
`--input-len` tokens and `--output-len` new tokens each, all queued at once) in an
engine of its own after a warm-up. The table gives output tokens/s with the median time
to first token and per output token of every setting, and names the fastest. It is
stored beside the product table (per host, thread count and model shape) and printed
again by `tokenmill tune --scheduler --report`.

The engine does not take it on its own: the budget trades latency for throughput (a
larger step carries more prefill, and every running request's next token waits for
it), which only whoever serves can weigh; the tune prints the flags to pass.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from tokenmill.attention.registry import ATTENTION_BACKENDS
from tokenmill.bench.driver import run_engine_workload, warm_up
from tokenmill.bench.metrics import summarize
from tokenmill.bench.workload import WorkloadSpec, build_workload
from tokenmill.config import EngineConfig
from tokenmill.layers.product_table import host_key
from tokenmill.layers.timing import CACHE


def parse_values(text: str, flag: str) -> tuple[int, ...]:
    """Positive integers separated by commas (a ValueError naming the flag otherwise)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must be positive integers separated by commas, got {text!r}")
    return values


def choose_setting(results: list[dict]) -> dict:
    """The setting with the most output tokens/s (the first listed among equals)."""
    return max(results, key=lambda r: r["output_tok_s"])


def scheduler_path(threads: int, shape: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in shape)
    return CACHE / "scheduler" / f"{host_key(threads)}-{safe}-{threads}t.json"


def measure_settings(model: str, budgets: tuple[int, ...], block_sizes: tuple[int, ...],
                     threads: int, spec: WorkloadSpec, backends: tuple[str, ...] = ("paged-native",),
                     progress=None) -> list[dict]:
    """One engine per (budget, block size, attention backend), the same workload
    through each."""
    from tokenmill.engine.engine import LLMEngine

    results = []
    for budget, block_size, backend in itertools.product(budgets, block_sizes, backends):
        config = EngineConfig.from_kwargs(model=model, num_threads=threads,
                                          max_num_batched_tokens=budget,
                                          block_size=block_size, attention_backend=backend)
        engine = LLMEngine(config, progress=False)
        try:
            warm_up(engine)
            workload = build_workload(spec, engine.arch.vocab_size, engine.tokenizer,
                                      engine.eos_token_ids)
            run = run_engine_workload(engine, workload, progress=False, id_prefix="tune")
            engine.check_integrity()
        finally:
            engine.shutdown()
        summary = summarize(run.records, run.duration_s)
        results.append({"max_num_batched_tokens": budget, "block_size": block_size,
                        "attention_backend": backend, "output_tok_s": summary.output_throughput,
                        "ttft_ms": summary.ttft_ms.median, "tpot_ms": summary.tpot_ms.median,
                        "steps": run.num_steps})
        if progress is not None:
            progress(format_row(results[-1]))
    return results


def format_row(r: dict) -> str:
    return (f"| {r['max_num_batched_tokens']} | {r['block_size']} | "
            f"{r['attention_backend']} | {r['output_tok_s']:.1f} | "
            f"{r['ttft_ms']:.0f} | {r['tpot_ms']:.1f} | {r['steps']} |")


def format_table(entry: dict) -> str:
    best = entry["choice"]
    lines = [f"scheduler tune: {entry['shape']}, {entry['threads']} threads, workload "
             f"{entry['workload']}",
             "| token budget | block size | attention | out tok/s | TTFT p50 ms | TPOT p50 ms "
             "| steps |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [format_row(r) for r in entry["results"]]
    lines.append(f"fastest: --max-num-batched-tokens {best['max_num_batched_tokens']} "
                 f"--block-size {best['block_size']} --attention-backend "
                 f"{best['attention_backend']} "
                 f"({best['output_tok_s']:.1f} out tok/s; "
                 f"compare its TTFT and TPOT with the others' before taking it)")
    return "\n".join(lines)


def cmd_tune_scheduler(args: argparse.Namespace, threads: int, shape: str) -> int:
    path = scheduler_path(threads, shape)
    if args.report:
        if not path.is_file():
            print(f"no scheduler tune stored for {shape} at {threads} threads on this host: "
                  f"run `tokenmill tune --scheduler --model ...`", file=sys.stderr)
            return 1
        print(format_table(json.loads(path.read_text())))
        return 0
    try:
        budgets = parse_values(args.budgets, "--budgets")
        block_sizes = parse_values(args.block_sizes, "--block-sizes")
        backends = tuple(b for b in args.attention_backends.split(",") if b)
        unknown = [b for b in backends if b not in ATTENTION_BACKENDS]
        if not backends or unknown:
            raise ValueError(f"--attention-backends must name backends among "
                             f"{sorted(ATTENTION_BACKENDS)}, got {args.attention_backends!r}")
        spec = WorkloadSpec(num_requests=args.num_requests, input_len=args.input_len,
                            output_len=args.output_len)
        if min(spec.num_requests, spec.input_len, spec.output_len) < 1:
            raise ValueError("--num-requests, --input-len and --output-len must be >= 1")
        print(f"tuning the scheduler for {shape} at {threads} threads: token budgets "
              f"{list(budgets)} x block sizes {list(block_sizes)}, {spec.num_requests} x "
              f"({spec.input_len} + {spec.output_len}) tokens each", flush=True)
        results = measure_settings(args.model, budgets, block_sizes, threads, spec, backends,
                                   progress=lambda line: print("  " + line, flush=True))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    entry = {"shape": shape, "model": str(args.model), "threads": threads,
             "workload": f"{spec.num_requests} x ({spec.input_len} + {spec.output_len})",
             "results": results, "choice": choose_setting(results)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entry, indent=1))
    print(format_table(entry))
    print(f"stored in {path}")
    return 0


def add_scheduler_arguments(tune: argparse.ArgumentParser) -> None:
    group = tune.add_argument_group("--scheduler: the token budget, block size and attention")
    group.add_argument("--scheduler", action="store_true",
                       help="measure the scheduler knobs instead of the products")
    group.add_argument("--budgets", default="512,1024,2048,4096",
                       help="step token budgets (--max-num-batched-tokens) to time")
    group.add_argument("--block-sizes", default="16,32", help="KV block sizes to time")
    group.add_argument("--attention-backends", default="paged-native",
                       help="attention backends to time (comma-separated)")
    group.add_argument("--num-requests", type=int, default=16)
    group.add_argument("--input-len", type=int, default=256)
    group.add_argument("--output-len", type=int, default=32)
