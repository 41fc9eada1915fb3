"""What model layers need from the tensor-parallel group they run in: their rank, the
group size, and the collectives. The default is a group of one (every call a no-op);
the worker binds a real group (tokenmill/dist/context.py) when it runs a shard.

The token-axis calls serve sequence parallelism. A model splits the step's tokens
after the embedding (`split_tokens`), gathers them before each column-parallel
projection (`gather_tokens`), and its row-parallel projections hand their partial
products to `reduce_partial`: an all-reduce without sequence parallelism, a
reduce-scatter over tokens with it. Without it the token calls are identities."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class Collectives(Protocol):
    rank: int
    size: int
    # MoE layers hold whole experts, E / size each (layers/moe.py), instead of shards.
    expert_parallel: bool

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns the tensor."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's tensor along the last dimension, in rank order."""

    def split_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the step's [T, hidden] (all of them without SP)."""

    def gather_tokens(self, local: torch.Tensor) -> torch.Tensor:
        """The step's [T, hidden] from every rank's rows (identity without SP)."""

    def reduce_partial(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum row-parallel partial products [T, hidden]: this rank's rows of the sum."""


class SingleRank:
    """A group of one: nothing to reduce or gather."""

    rank = 0
    size = 1
    expert_parallel = False

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def split_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def gather_tokens(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def reduce_partial(self, partial: torch.Tensor) -> torch.Tensor:
        return partial


SINGLE_RANK = SingleRank()


def bind_collectives(model: nn.Module, group: Collectives) -> None:
    """Give every module that talks to its group (those with a `group` attribute: the
    vocab-parallel embedding, the decoder layers, the MoE layer) the group it runs in."""
    for module in model.modules():
        if hasattr(module, "group"):
            module.group = group
