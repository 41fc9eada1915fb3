"""`tokenmill serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import sys

from tokenmill.arguments import add_engine_arguments, engine_config_from_args
from tokenmill.server.app import DEFAULT_MAX_BODY_BYTES
from tokenmill.server.serve import API_KEY_ENV, run_server


def add_serve_subcommand(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_arguments(serve)
    serve.add_argument("--log-level", default="info")
    add_engine_arguments(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    for name in ("max_queue", "shutdown_grace"):
        if getattr(args, name) < 0:
            print(f"error: --{name.replace('_', '-')} must be >= 0", file=sys.stderr)
            return 2
    for name in ("max_body_bytes", "stream_interval"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.thinking_budget is not None and args.thinking_budget < 0:
        print("error: --thinking-budget must be >= 0", file=sys.stderr)
        return 2
    try:
        config = engine_config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        run_server(config, host=args.host, port=args.port, api_key=args.api_key,
                   served_model_name=args.served_model_name, max_queue=args.max_queue,
                   max_body_bytes=args.max_body_bytes, shutdown_grace_s=args.shutdown_grace,
                   log_level=args.log_level, default_thinking_budget=args.thinking_budget,
                   stream_interval=args.stream_interval)
    except ValueError as exc:  # the model and the flags disagree (found at start-up)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help=f"require this bearer key (default: ${API_KEY_ENV} if set)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients must send (default: the model directory's name)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="sequences that may wait beyond max_num_seqs before 429")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--shutdown-grace", type=float, default=10.0,
                        help="seconds in-flight requests get to finish on SIGTERM")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="streamed responses: send a request's tokens once this many are "
                             "new (its first and last at once); fewer, larger chunks cost the "
                             "server and client less CPU (default: every token)")
    parser.add_argument("--thinking-budget", type=int, default=None,
                        help="reasoning models: the thinking budget (tokens) of requests that "
                             "send none (default: unlimited)")
