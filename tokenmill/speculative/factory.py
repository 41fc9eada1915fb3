"""Build the configured proposer in the worker (or None when speculation is off),
through the method's module named in `registry.py`."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.config import EngineConfig
from tokenmill.layers.linear import LinearSelector
from tokenmill.model.arch import ArchConfig
from tokenmill.model.loader import LoadedModel
from tokenmill.speculative.base import Proposer
from tokenmill.speculative.registry import SPECULATIVE_METHODS


@dataclass(frozen=True)
class ProposerFootprint:
    """What a proposer's own model takes beside the target's, for memory planning."""

    arch: ArchConfig  # the geometry of its KV pool (as many blocks as the target's)
    num_parameters: int
    # Whether it has an LM head of its own (tied to its embedding: a repacking product
    # policy keeps two copies of it).
    has_lm_head: bool


@dataclass
class ProposerContext:
    config: EngineConfig
    target_arch: ArchConfig
    device: torch.device
    dtype: torch.dtype
    # The method's model directory (None for methods without one).
    model_dir: Path | None
    # Set when building: the loaded target, the KV pool size, the kernels to use.
    target: LoadedModel | None = None
    num_blocks: int = 0
    select_linear: LinearSelector | None = None
    progress: bool = False


def proposer_context(config: EngineConfig, target_arch: ArchConfig, device: torch.device,
                     dtype: torch.dtype) -> ProposerContext | None:
    """What the configured method is built from; None when speculation is off.

    Raises ValueError when the method's model directory does not exist.
    """
    name = config.spec.speculative_method
    if name is None:
        return None
    method = SPECULATIVE_METHODS.get(name)
    if method is None:
        raise ValueError(f"speculative_method must be one of {tuple(SPECULATIVE_METHODS)} "
                         f"or None, got {name!r}")
    model_dir = method.model_dir(config.model.model, config.spec.speculative_model)
    if model_dir is not None and not (model_dir / "config.json").is_file():
        raise ValueError(f"speculative_model: {str(model_dir)!r} is not a {name} model "
                         "directory (no config.json); pass --speculative-model")
    return ProposerContext(config, target_arch, device, dtype, model_dir)


def _module(context: ProposerContext):
    return importlib.import_module(
        SPECULATIVE_METHODS[context.config.spec.speculative_method].module)


def proposer_footprint(context: ProposerContext | None) -> ProposerFootprint | None:
    """The proposer's own model (its KV pool's geometry and its weights), or None."""
    return _module(context).proposer_footprint(context) if context is not None else None


def build_proposer(context: ProposerContext | None) -> Proposer | None:
    return _module(context).build_proposer(context) if context is not None else None
