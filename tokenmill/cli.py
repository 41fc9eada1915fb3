"""`tokenmill` command line: generate, serve, bench, plan, profile, simulate, tune, train,
quantize, calibrate.

This module only dispatches: each command's flags and body live in its own module
(tokenmill/generate.py, server/command.py, bench/commands.py, plan/command.py,
profile/command.py, train/cli.py, quantize.py, calibrate.py); the shared engine and
sampling flags are in tokenmill/arguments.py. A command's module is imported when the
command runs (all of them only for the overview, `tokenmill --help`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from tokenmill.layers.isa import (
    CHOICES,
    capped_environment,
    capped_isa,
    needs_restart,
    split_isa_argument,
)

# command -> (module, function adding its subparser)
COMMANDS = {
    "generate": ("tokenmill.generate", "add_generate_subcommand"),
    "serve": ("tokenmill.server.command", "add_serve_subcommand"),
    "bench": ("tokenmill.bench.commands", "add_bench_subcommands"),
    "plan": ("tokenmill.plan.command", "add_plan_subcommand"),
    "profile": ("tokenmill.profile.command", "add_profile_subcommand"),
    "simulate": ("tokenmill.plan.moe_sim", "add_simulate_subcommand"),
    "tune": ("tokenmill.bench.tune", "add_tune_subcommand"),
    "quantize": ("tokenmill.quantize", "add_quantize_subcommand"),
    "calibrate": ("tokenmill.calibrate", "add_calibrate_subcommand"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with `command` only that command's flags: the other
    commands' modules (the server's web framework, the benchmarks) then never load,
    which took ~0.5 s of every start (`tokenmill generate` to its first token)."""
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__.splitlines()[0])
    # Read by `main` before anything loads; listed here for --help.
    parser.add_argument("--isa", choices=CHOICES, default="native",
                        help="run as a host with this instruction set would: avx2 compiles "
                             "tokenmill's kernels without AVX-512 and caps PyTorch, oneDNN, "
                             "MKL and OpenBLAS at AVX2 (also TOKENMILL_ISA); must come first")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, add) in COMMANDS.items():
        if command in (None, name):
            getattr(importlib.import_module(module), add)(sub)
    # Listed for --help; `main` hands its arguments to tokenmill.train's own parser.
    sub.add_parser("train", add_help=False,
                   help="train the tokenizer and default models (tokenmill train --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        isa, argv = split_isa_argument(argv)
        isa = isa or capped_isa()  # TOKENMILL_ISA alone caps the libraries too
        if isa is not None and needs_restart(isa):
            # The libraries read their instruction-set switches when they load: start
            # again with them set (tokenmill/layers/isa.py).
            os.execve(sys.executable, [sys.executable, "-m", "tokenmill", *argv],
                      capped_environment(isa))
    except ValueError as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2
    if argv[:1] == ["train"]:
        train = importlib.import_module("tokenmill.train.cli")
        return train.main(argv[1:])
    parser = build_parser(argv[0] if argv[:1] and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
