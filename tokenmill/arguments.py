"""Command-line flags for the engine and for sampling, shared by every command.

Engine flags are generated from EngineConfig's fields (one source of truth): every
field `foo_bar` is `--foo-bar`; booleans take `--foo-bar/--no-foo-bar`; a field whose
metadata points at a registry (speculative methods, attention backends) takes the
registered names as its choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import types
import typing
from typing import Any

from tokenmill.config import EngineConfig, config_fields
from tokenmill.sampling_params import SamplingParams

# Sampling flags (the engine's --seed seeds unseeded sampling, so runs reproduce).
SAMPLING_FLAGS = {
    "max_tokens": int, "min_tokens": int, "temperature": float, "top_p": float, "top_k": int,
    "min_p": float, "presence_penalty": float, "frequency_penalty": float,
    "repetition_penalty": float, "n": int, "thinking_budget": int, "min_thinking": int,
    "thinking_bridge": str,
}


def _flag_type(field: dataclasses.Field) -> tuple[Any, tuple | None]:
    """(argparse type, choices) from a dataclass field's annotation, or from the names
    in the registry its metadata points at ("module:TABLE")."""
    if "registry" in field.metadata:
        module, table = field.metadata["registry"].split(":")
        return str, tuple(getattr(importlib.import_module(module), table))
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
