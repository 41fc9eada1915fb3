"""`tokenmill bench throughput`: offline engine throughput on a workload.

All requests are queued at once (or --max-concurrency at a time) and the engine
steps until they finish. Reports requests/s, input and output tokens/s, latency
distributions, and the run's place against the machine's roofline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.bench.ceilings import Ceilings, machine_ceilings
from tokenmill.bench.driver import EngineRun, run_engine_workload, warm_up
from tokenmill.bench.metrics import NO_SLO, SLO, RunSummary, format_summary, summarize
from tokenmill.bench.roofline import ModelCost, Roofline, format_roofline, run_roofline
from tokenmill.bench.workload import WorkloadRequest
from tokenmill.engine.engine import LLMEngine


@dataclass
class ThroughputResult:
    run: EngineRun
    summary: RunSummary
    roofline: Roofline | None

    def to_json(self) -> dict:
        return {"summary": self.summary.to_json(), "num_steps": self.run.num_steps,
                "spec_draft_tokens": self.run.spec_draft_tokens,
                "spec_accepted_tokens": self.run.spec_accepted_tokens,
                "roofline": self.roofline.to_json() if self.roofline else None,
                "requests": [r.to_json() for r in self.run.records]}


def engine_cost(engine: LLMEngine) -> ModelCost:
    cost = ModelCost.of(engine.arch, engine.info.dtype_itemsize)
    # The KV read per token is what the pool stores: 1-byte codes + scales when quantized.
    plan = engine.kv_plan
    return dataclasses.replace(cost, kv_bytes_per_token=plan.bytes_per_block // plan.block_size)


def measure_throughput(engine: LLMEngine, workload: list[WorkloadRequest],
                       ceilings: Ceilings | None, max_concurrency: int | None = None,
                       slo: SLO = NO_SLO, progress: bool = True, desc: str = "throughput"
                       ) -> ThroughputResult:
    run = run_engine_workload(engine, workload, max_concurrency, progress, desc)
    summary = summarize(run.records, run.duration_s, slo)
    roofline = None
    if ceilings is not None:
        roofline = run_roofline(engine_cost(engine), ceilings,
                                [r.prompt_tokens for r in run.records],
                                [r.output_tokens for r in run.records], run.num_steps,
                                run.duration_s)
    return ThroughputResult(run, summary, roofline)


# ---- command line ------------------------------------------------------------------------
def add_engine_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by the in-process benchmarks: engine, workload, output."""
    from tokenmill.arguments import add_engine_arguments
    from tokenmill.bench.workload import add_workload_arguments

    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    parser.add_argument("--no-roofline", action="store_true",
                        help="skip measuring the machine's ceilings")
    parser.add_argument("--log-level", default="warning")
    add_workload_arguments(parser)
    add_engine_arguments(parser)


def load_engine_and_workload(args: argparse.Namespace
                             ) -> tuple[LLMEngine, list[WorkloadRequest], Ceilings | None]:
    from tokenmill.arguments import engine_config_from_args
    from tokenmill.bench.workload import build_workload, workload_spec_from_args

    config = engine_config_from_args(args)
    spec = workload_spec_from_args(args)
    engine = LLMEngine(config)
    workload = build_workload(spec, engine.arch.vocab_size, engine.tokenizer,
                              engine.eos_token_ids)
    ceilings = None if args.no_roofline else machine_ceilings(torch.get_num_threads())
    return engine, workload, ceilings


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    try:
        engine, workload, ceilings = load_engine_and_workload(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    warm_up(engine)
    result = measure_throughput(engine, workload, ceilings, args.max_concurrency,
                                SLO(args.slo_ttft, args.slo_tpot))
    print(format_summary(result.summary, f"tokenmill throughput, {engine.config.model.model}"))
    print(f"{result.run.num_steps} engine steps")
    if result.run.spec_draft_tokens:
        print(f"speculative decoding: {result.run.spec_accepted_tokens} of "
              f"{result.run.spec_draft_tokens} draft tokens accepted "
              f"({result.run.spec_acceptance:.1%})")
    if result.roofline is not None:
        print(format_roofline(result.roofline, ceilings))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result.to_json(), indent=2))
        print(f"wrote {args.out}")
    return 0


def add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at once (default: all)")
    parser.add_argument("--slo-ttft", type=float, default=None, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=None, help="seconds")
    add_engine_bench_arguments(parser)
    parser.set_defaults(func=cmd_bench_throughput)
