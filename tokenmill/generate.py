"""`tokenmill generate`: complete one prompt, streaming tokens as they come."""

from __future__ import annotations

import argparse
import sys

from tokenmill.arguments import (
    add_engine_arguments,
    add_sampling_arguments,
    engine_config_from_args,
    sampling_params_from_args,
)


def add_generate_subcommand(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="complete one prompt, streaming tokens as they come")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--echo", action="store_true", help="print the prompt before the output")
    gen.add_argument("--log-level", default="warning")
    add_engine_arguments(gen)
    add_sampling_arguments(gen)
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill.engine.engine import LLMEngine

    try:
        config = engine_config_from_args(args)
        params = sampling_params_from_args(args)
        engine = LLMEngine(config)
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
