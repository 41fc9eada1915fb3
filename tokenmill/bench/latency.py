"""`tokenmill bench latency`: one batch, repeated, at batch sizes 1..N.

Each repetition queues B identical-length requests at once (fresh seeded prompts,
so the prefix cache cannot hit) and runs them to completion. Batch sizes are
interleaved across repetitions (1 2 4 .. 1 2 4 ..) so drift on a shared machine
hits all of them alike; medians over repetitions are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from tokenmill.bench.driver import run_engine_workload, warm_up
from tokenmill.bench.workload import WorkloadSpec, build_workload
from tokenmill.engine.engine import LLMEngine


@dataclass(frozen=True)
class BatchLatency:
    batch_size: int
    ttft_ms: float  # median over repetitions of the batch's mean TTFT
    tpot_ms: float  # median over repetitions of the batch's mean TPOT
    e2e_ms: float
    output_throughput: float  # output tokens/s of the whole batch


def default_batch_sizes(max_batch: int) -> list[int]:
    """Powers of two up to max_batch, and max_batch itself."""
    sizes = [1]
    while sizes[-1] * 2 <= max_batch:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def measure_latency(engine: LLMEngine, batch_sizes: list[int], input_len: int,
                    output_len: int, repeats: int, seed: int = 0, progress: bool = True
                    ) -> list[BatchLatency]:
    samples: dict[int, list[tuple[float, float, float, float]]] = {b: [] for b in batch_sizes}
    runs = [(rep, b) for rep in range(repeats) for b in batch_sizes]
    for rep, batch in tqdm(runs, desc="latency", disable=not progress):
        spec = WorkloadSpec(num_requests=batch, input_len=input_len, output_len=output_len,
                            seed=seed + 1000 * rep + batch)
        workload = build_workload(spec, engine.arch.vocab_size,
                                  avoid_token_ids=engine.eos_token_ids)
        run = run_engine_workload(engine, workload, progress=False, id_prefix=f"lat{rep}-{batch}")
        records = run.records
        samples[batch].append((
            statistics.mean(r.ttft for r in records), statistics.mean(r.tpot for r in records),
            statistics.mean(r.e2e for r in records),
            sum(r.output_tokens for r in records) / run.duration_s))
    results = []
    for batch in batch_sizes:
        ttft, tpot, e2e, tput = (statistics.median(column) for column in zip(*samples[batch],
                                                                              strict=True))
        results.append(BatchLatency(batch, 1000 * ttft, 1000 * tpot, 1000 * e2e, tput))
    return results


def format_latency(results: list[BatchLatency], input_len: int, output_len: int) -> str:
    base = results[0]
    lines = [f"prompt {input_len} tokens, {output_len} new tokens; medians",
             "| batch | TTFT ms | TPOT ms | E2E ms | out tok/s | tok/s vs batch "
             f"{base.batch_size} |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r.batch_size} | {r.ttft_ms:.1f} | {r.tpot_ms:.2f} | {r.e2e_ms:.1f} | "
                     f"{r.output_throughput:.1f} | "
                     f"{r.output_throughput / base.output_throughput:.2f}x |")
    return "\n".join(lines)


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from tokenmill.arguments import engine_config_from_args

    try:
        config = engine_config_from_args(args)
        sizes = ([int(s) for s in args.batch_sizes.split(",")] if args.batch_sizes
                 else default_batch_sizes(args.max_batch))
        if min(sizes) < 1 or args.repeats < 1:
            raise ValueError("batch sizes and --repeats must be >= 1")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = LLMEngine(config)
    warm_up(engine)
    results = measure_latency(engine, sizes, args.input_len, args.output_len, args.repeats,
                              args.workload_seed)
    print(format_latency(results, args.input_len, args.output_len))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([asdict(r) for r in results], indent=2))
        print(f"wrote {args.out}")
    return 0


def add_latency_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.arguments import add_engine_arguments

    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--batch-sizes", default=None, help="comma-separated, e.g. 1,4,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--log-level", default="warning")
    add_engine_arguments(parser)
    parser.set_defaults(func=cmd_bench_latency)
