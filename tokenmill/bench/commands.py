"""`tokenmill bench ...`: the subcommands, wired into tokenmill.cli's parser."""

from __future__ import annotations

import argparse
import os


def add_bench_subcommands(sub: argparse._SubParsersAction) -> None:
    from tokenmill.bench.collectives import add_collectives_arguments
    from tokenmill.bench.compare import add_compare_arguments
    from tokenmill.bench.latency import add_latency_arguments
    from tokenmill.bench.moe import add_moe_arguments
    from tokenmill.bench.serve_load import add_serve_bench_arguments, cmd_bench_serve
    from tokenmill.bench.throughput import add_throughput_arguments

    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, compare, peers")
    commands = bench.add_subparsers(dest="bench_command", required=True)
    add_throughput_arguments(commands.add_parser(
        "throughput", help="offline engine throughput on a workload, with roofline fractions"))
    add_latency_arguments(commands.add_parser(
        "latency", help="TTFT and per-token latency of one batch at batch sizes 1..N"))
    serve = commands.add_parser("serve", help="load an OpenAI-compatible /v1/completions server")
    add_serve_bench_arguments(serve)
    serve.add_argument("--log-level", default="warning")
    serve.set_defaults(func=cmd_bench_serve)
    add_compare_arguments(commands.add_parser(
        "compare", help="one workload across engine configs and peers; Markdown + PNG report"))
    _add_peers_arguments(commands.add_parser(
        "peers", help="detect or install peer engines (transformers, llama.cpp, vLLM)"))
    add_moe_arguments(commands.add_parser(
        "moe", help="expert load of a mixture-of-experts model on a workload: imbalance "
                    "per layer and a heat map"))
    add_collectives_arguments(commands.add_parser(
        "collectives", help="all-reduce latency and bandwidth by algorithm, with an "
                            "alpha-beta fit"))


def _cmd_peers(args: argparse.Namespace) -> int:
    from tokenmill.bench.peer_install import install_peers
    from tokenmill.bench.peer_registry import INSTALLABLE, PEERS

    if args.action == "install":
        return install_peers(args.peer or list(INSTALLABLE), torch_wheel=args.torch_wheel,
                             jobs=args.jobs)
    for name in args.peer or list(PEERS):
        found = PEERS[name]().detect()
        print(f"{name}: {found or 'not installed'}")
    return 0


def _add_peers_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.bench.peer_registry import PEERS

    parser.add_argument("action", choices=("list", "install"), nargs="?", default="list")
    parser.add_argument("--peer", action="append", choices=sorted(PEERS), default=None,
                        help="repeatable; default: all (install: llamacpp and vllm)")
    parser.add_argument("--torch-wheel", default=None,
                        help="the local torch wheel to pin peers to (default: /opt/wheels)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2,
                        help="parallel compile jobs for llama.cpp")
    parser.add_argument("--log-level", default="warning")
    parser.set_defaults(func=_cmd_peers)
