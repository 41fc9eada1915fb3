"""Build the configured proposer (or None when speculative decoding is off)."""

from __future__ import annotations

from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.layers.linear import LinearSelector
from tokenmill.model.arch import ArchConfig
from tokenmill.model.loader import LoadedModel
from tokenmill.speculative.base import Proposer


def default_speculative_model(config: EngineConfig) -> Path:
    """draft: "<model>-draft" beside the target; eagle: "<model>/eagle"."""
    target = Path(config.model.model)
    if config.spec.speculative_method == "draft":
        return target.with_name(target.name + "-draft")
    return target / "eagle"


def build_proposer(config: EngineConfig, arch: ArchConfig, target: LoadedModel,
                   num_blocks: int, progress: bool = False,
                   select_linear: LinearSelector | None = None) -> Proposer | None:
    spec = config.spec
    method = spec.speculative_method
    if method is None:
        return None
    if method == "ngram":
        from tokenmill.speculative.ngram import NgramProposer
        return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
    path = Path(spec.speculative_model) if spec.speculative_model else (
        default_speculative_model(config))
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_model: {str(path)!r} is not a {method} model directory "
                         "(no config.json); pass --speculative-model")
    if method == "draft":
        from tokenmill.speculative.draft import DraftModelProposer
        return DraftModelProposer(str(path), arch.vocab_size, target.device, target.dtype,
                                  num_blocks, config.cache.block_size, spec.draft_micro_batch,
                                  seed=config.model.seed, progress=progress,
                                  select_linear=select_linear)
    from tokenmill.speculative.eagle import EagleProposer
    return EagleProposer.load(str(path), target.model, arch, target.device, target.dtype,
                              num_blocks, config.cache.block_size, spec.draft_micro_batch,
                              seed=config.model.seed, select_linear=select_linear)
