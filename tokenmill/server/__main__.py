"""`python -m tokenmill.server --model DIR --port N`: a small CLI for run_server.

Every EngineConfig field is a flag (`--max-num-seqs 8`, `--no-enable-prefix-caching`).
"""

from __future__ import annotations

import argparse
import dataclasses

from tokenmill.config import EngineConfig, config_fields
from tokenmill.server.app import DEFAULT_MAX_BODY_BYTES
from tokenmill.server.serve import API_KEY_ENV, run_server


def _flag_type(field: dataclasses.Field):
    annotation = str(field.type)
    if "bool" in annotation:
        return None
    if "int" in annotation:
        return int
    if "float" in annotation:
        return float
    return str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tokenmill.server",
                                     description="OpenAI-compatible tokenmill server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help=f"require this bearer key (default: ${API_KEY_ENV} if set)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients must send (default: the --model value)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="sequences that may wait beyond max_num_seqs before 429")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--shutdown-grace", type=float, default=10.0,
                        help="seconds in-flight requests get to finish on SIGTERM")
    parser.add_argument("--log-level", default="info")
    engine = parser.add_argument_group("engine")
    for _, field in config_fields():
        flag = "--" + field.name.replace("_", "-")
        kind = _flag_type(field)
        if kind is None:
            engine.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction,
                                default=None)
        else:
            engine.add_argument(flag, dest=field.name, type=kind, default=None)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_queue < 0:
        parser.error("--max-queue must be >= 0")
    if args.max_body_bytes < 1:
        parser.error("--max-body-bytes must be >= 1")
    if args.shutdown_grace < 0:
        parser.error("--shutdown-grace must be >= 0")
    engine_options = {field.name: getattr(args, field.name) for _, field in config_fields()
                      if getattr(args, field.name) is not None}
    try:
        config = EngineConfig.from_kwargs(**engine_options)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    run_server(config, host=args.host, port=args.port, api_key=args.api_key,
               served_model_name=args.served_model_name, max_queue=args.max_queue,
               max_body_bytes=args.max_body_bytes, shutdown_grace_s=args.shutdown_grace,
               log_level=args.log_level)


if __name__ == "__main__":
    main()
