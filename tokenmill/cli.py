"""`tokenmill` command line: generate, serve, train, ...

Engine flags are generated from EngineConfig's fields (one source of truth): every
field `foo_bar` is `--foo-bar`; booleans take `--foo-bar/--no-foo-bar`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import types
import typing
from typing import Any

from tokenmill.config import EngineConfig, config_fields
from tokenmill.sampling_params import SamplingParams

# Sampling flags (the engine's --seed seeds unseeded sampling, so runs reproduce).
SAMPLING_FLAGS = {
    "max_tokens": int, "min_tokens": int, "temperature": float, "top_p": float, "top_k": int,
    "min_p": float, "presence_penalty": float, "frequency_penalty": float,
    "repetition_penalty": float, "n": int,
}


def _flag_type(field: dataclasses.Field) -> tuple[Any, tuple | None]:
    """(argparse type, choices) from a dataclass field's annotation (or its registry's
    names, in the field's metadata)."""
    if "choices" in field.metadata:
        return str, field.metadata["choices"]
    annotation = field.type if not isinstance(field.type, str) else eval(  # noqa: S307
        field.type, vars(typing) | {"Literal": typing.Literal})
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is typing.Literal:
        return str, typing.get_args(annotation)
    return annotation, None


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for _part, field in config_fields():
        flag = "--" + field.name.replace("_", "-")
        default = field.default if field.default is not dataclasses.MISSING else None
        kind, choices = _flag_type(field)
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=f"(default: {default})")
        else:
            group.add_argument(flag, type=kind, choices=choices, default=None,
                               help=f"(default: {default})")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    options = {name: getattr(args, name) for _part, field in config_fields()
               if (name := field.name) in vars(args) and getattr(args, name) is not None}
    return EngineConfig.from_kwargs(**options)


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int = 64) -> None:
    group = parser.add_argument_group("sampling")
    for name, kind in SAMPLING_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), type=kind,
                           default=max_tokens if name == "max_tokens" else None)
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    options = {name: getattr(args, name) for name in SAMPLING_FLAGS
               if getattr(args, name) is not None}
    if args.temperature is None:
        options["temperature"] = 0.0  # the CLI defaults to greedy: reproducible output
    return SamplingParams(stop=args.stop, ignore_eos=args.ignore_eos, **options)


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill.engine.engine import LLMEngine

    try:
        config = engine_config_from_args(args)
        params = sampling_params_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = LLMEngine(config)
    try:
        engine.add_request("cli", args.prompt, params)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shown = [0] * params.n
    if args.echo:
        sys.stdout.write(args.prompt)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            for completion in output.outputs:
                if params.n == 1:
                    sys.stdout.write(completion.text[shown[0]:])
                    shown[0] = len(completion.text)
            sys.stdout.flush()
            final = output
    if final is not None:
        if params.n > 1:
            for completion in final.outputs:
                print(f"--- completion {completion.index} ({completion.finish_reason})")
                print(completion.text)
        else:
            print()
        metrics = final.outputs[0].metrics
        print(f"[{sum(len(c.token_ids) for c in final.outputs)} tokens, "
              f"ttft {metrics.time_to_first_token * 1000:.0f} ms, "
              f"tpot {metrics.time_per_output_token * 1000:.1f} ms, "
              f"finish: {final.outputs[0].finish_reason}]", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.server.serve import run_server

    for name in ("max_queue", "shutdown_grace"):
        if getattr(args, name) < 0:
            print(f"error: --{name.replace('_', '-')} must be >= 0", file=sys.stderr)
            return 2
    if args.max_body_bytes < 1:
        print("error: --max-body-bytes must be >= 1", file=sys.stderr)
        return 2
    try:
        config = engine_config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_server(config, host=args.host, port=args.port, api_key=args.api_key,
               served_model_name=args.served_model_name, max_queue=args.max_queue,
               max_body_bytes=args.max_body_bytes, shutdown_grace_s=args.shutdown_grace,
               log_level=args.log_level)
    return 0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.server.app import DEFAULT_MAX_BODY_BYTES
    from tokenmill.server.serve import API_KEY_ENV

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt, streaming tokens as they come")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--echo", action="store_true", help="print the prompt before the output")
    gen.add_argument("--log-level", default="warning")
    add_engine_arguments(gen)
    add_sampling_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_arguments(serve)
    serve.add_argument("--log-level", default="info")
    add_engine_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    from tokenmill.bench.commands import add_bench_subcommands
    from tokenmill.plan.command import add_plan_subcommand
    from tokenmill.profile.command import add_profile_subcommand

    add_bench_subcommands(sub)
    add_plan_subcommand(sub)
    add_profile_subcommand(sub)
    # Listed for --help; `main` hands its arguments to tokenmill.train's own parser.
    sub.add_parser("train", add_help=False,
                   help="train the tokenizer and default models (tokenmill train --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        from tokenmill.train.cli import main as train_main

        return train_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
