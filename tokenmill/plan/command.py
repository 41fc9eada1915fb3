"""`tokenmill plan memory`: weights + KV + activations for a context and concurrency,
and whether they fit. The arithmetic is `tokenmill.worker.memory`'s, the same the
engine sizes its KV pool with."""

from __future__ import annotations

import argparse
import sys

from tokenmill.plan.parallel_command import add_parallel_arguments


def add_plan_subcommand(sub: argparse._SubParsersAction) -> None:
    from tokenmill.arguments import add_engine_arguments

    plan = sub.add_parser("plan", help="capacity planning")
    targets = plan.add_subparsers(dest="plan_target", required=True)
    memory = targets.add_parser("memory", help="weights + KV + activations, and the fit")
    memory.add_argument("--context", type=int, required=True, help="tokens per sequence")
    memory.add_argument("--concurrency", type=int, required=True,
                        help="concurrent sequences")
    memory.add_argument("--device-memory", type=int, default=None,
                        help="bytes available (default: free memory of the device)")
    memory.add_argument("--log-level", default="warning")
    add_engine_arguments(memory)
    memory.set_defaults(func=cmd_plan_memory)
    add_parallel_arguments(targets.add_parser(
        "parallel", help="rank TP x PP layouts of a model on a cluster (a cost model)"))
    lessons = targets.add_parser("lessons", help="the reports' layout lessons, put to the "
                                                 "parallel cost model")
    lessons.add_argument("--log-level", default="warning")
    lessons.set_defaults(func=cmd_plan_lessons)


def cmd_plan_lessons(args: argparse.Namespace) -> int:
    from tokenmill.plan.lessons import report

    print(report())
    return 0


def cmd_plan_memory(args: argparse.Namespace) -> int:
    """Prints the plan; exit status 0 when it fits, 1 when it does not, 2 on bad input."""
    from tokenmill.arguments import engine_config_from_args
    from tokenmill.worker.memory import plan_deployment_memory

    try:
        config = engine_config_from_args(args)
        plan = plan_deployment_memory(config, args.context, args.concurrency,
                                      args.device_memory)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(plan.format())
    return 0 if plan.fits else 1
