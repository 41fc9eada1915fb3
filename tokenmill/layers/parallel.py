"""What model layers need from the tensor-parallel group they run in: their rank, the
group size, and two collectives. The default is a group of one (every call a no-op);
the worker binds a real group (tokenmill/dist/context.py) when it runs a shard."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class Collectives(Protocol):
    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns the tensor."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's tensor along the last dimension, in rank order."""


class SingleRank:
    """A group of one: nothing to reduce or gather."""

    rank = 0
    size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


SINGLE_RANK = SingleRank()


def bind_collectives(model: nn.Module, group: Collectives) -> None:
    """Give every module that talks to its group (those with a `group` attribute: the
    vocab-parallel embedding, the MoE layer) the group it runs in."""
    for module in model.modules():
        if hasattr(module, "group"):
            module.group = group
