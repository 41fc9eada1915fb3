"""`tokenmill profile`: run a workload with the step tracer and write the trace."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenmill.profile.summary import format_time_summary, summarize_steps
from tokenmill.profile.tracer import StepTracer


def add_profile_subcommand(sub: argparse._SubParsersAction) -> None:
    from tokenmill.arguments import add_engine_arguments
    from tokenmill.bench.workload import add_workload_arguments

    parser = sub.add_parser("profile", help="trace engine steps into Chrome/Perfetto JSON")
    parser.add_argument("--out", type=Path, default=Path("trace.json"))
    parser.add_argument("--summary-json", type=Path, default=None,
                        help="also write the time summary here")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--torch-profile-steps", type=int, default=0,
                        help="run the first N steps under torch.profiler too "
                             "(written next to --out as *.torch.json)")
    parser.add_argument("--log-level", default="warning")
    add_workload_arguments(parser, num_requests=16)
    add_engine_arguments(parser)
    parser.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    from tokenmill.arguments import engine_config_from_args
    from tokenmill.bench.driver import run_engine_workload, warm_up
    from tokenmill.bench.workload import build_workload, workload_spec_from_args
    from tokenmill.engine.engine import LLMEngine

    try:
        config = engine_config_from_args(args)
        spec = workload_spec_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = LLMEngine(config)
    workload = build_workload(spec, engine.arch.vocab_size, engine.tokenizer,
                              engine.eos_token_ids)
    warm_up(engine)
    torch_path = args.out.with_suffix(".torch.json") if args.torch_profile_steps else None
    tracer = StepTracer(torch_profile_steps=args.torch_profile_steps,
                        torch_trace_path=torch_path).attach(engine)
    try:
        run_engine_workload(engine, workload, args.max_concurrency, desc="profiling")
    finally:
        tracer.detach(engine)
    tracer.write(args.out)
    summary = summarize_steps(tracer.steps)
    print(format_time_summary(summary))
    print(f"trace: {args.out}" + (f", torch trace: {torch_path}" if torch_path else ""))
    if args.summary_json:
        args.summary_json.write_text(json.dumps(summary.to_json(), indent=2))
    return 0
