"""Pipeline parallelism: the decoder layers split into consecutive stages, one per group
of tensor-parallel ranks, each stage's hidden states sent to the next.

Ranks are laid out stage-major: rank = stage * TP + tp_rank, so a stage's TP ranks
are neighbours (on a real cluster: inside one node, where TP's all-reduces belong;
only the stage-to-stage sends cross nodes). TP rank i of a stage sends to TP rank i
of the next one: each holds the whole [T, hidden] of the step.

A stage holds only its layers: the first also the embedding, the last the final norm
and the LM head (a tied head is the embedding: both ends load it). Its model is built
with its layers numbered from 0 (its KV pool holds only them), and checkpoint
tensors are renamed to those numbers or skipped (`local_name`).

Within a step, the scheduled requests are cut into micro-batches (contiguous runs in
batch order, about equal in tokens): the first stage sends micro-batch 0 and goes on
to micro-batch 1 while the next stage computes micro-batch 0. A step's requests are
not split inside, so one long prefill is one micro-batch. Steps do not overlap: the
engine schedules the next step once the last stage has sampled this one (its tokens
decide what comes next), so each step pays the pipeline's fill and drain.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tokenmill.model.arch import ArchConfig

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")


@dataclass(frozen=True)
class PipelineStage:
    """One stage: which of the model's layers it runs and where its neighbours are."""

    index: int
    count: int
    start: int  # first layer (of the whole model)
    end: int  # one past its last layer
    tp_size: int = 1
    tp_rank: int = 0

    @classmethod
    def of(cls, index: int, count: int, num_layers: int, tp_size: int = 1,
           tp_rank: int = 0) -> PipelineStage:
        """Stage `index` of `count`, the layers split as evenly as they go."""
        if not 1 <= count <= num_layers:
            raise ValueError(f"pipeline_parallel_size {count} must be between 1 and the "
                             f"model's {num_layers} layers")
        return cls(index, count, num_layers * index // count,
                   num_layers * (index + 1) // count, tp_size, tp_rank)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def previous_rank(self) -> int:
        return (self.index - 1) * self.tp_size + self.tp_rank

    @property
    def next_rank(self) -> int:
        return (self.index + 1) * self.tp_size + self.tp_rank

    def arch(self, arch: ArchConfig) -> ArchConfig:
        """The geometry of this stage's model: its layers only."""
        return dataclasses.replace(arch, num_layers=self.end - self.start,
                                   first_layer=self.start)

    def local_name(self, name: str, tied: bool) -> str | None:
        """A checkpoint tensor's name in this stage's model, or None: not its own."""
        match = _LAYER.match(name)
        if match:
            layer = int(match.group(1))
            if not self.start <= layer < self.end:
                return None
            return f"model.layers.{layer - self.start}.{match.group(2)}"
        if name.startswith("model.embed_tokens."):
            return name if self.first or (tied and self.last) else None
        if name.startswith("lm_head."):
            return name if self.last else None
        if name.startswith("model.norm."):
            return name if self.last else None
        return name

    def prune(self, model: nn.Module) -> None:
        """Drop the modules another stage runs (the model was built for this stage's
        layers): the embedding off the first stage, the final norm and the LM head off
        the last (a tied head stays on the first stage too: it is the embedding)."""
        tied = model.arch.tie_word_embeddings
        if not self.first:
            model.model.embed_tokens = None
        if not self.last:
            model.model.norm = None
            if not (tied and self.first):
                model.lm_head = None


def micro_batches(token_counts: list[int], count: int) -> list[range]:
    """Cut requests (their tokens, in batch order) into at most `count` contiguous runs
    of about equal tokens; none empty."""
    total = sum(token_counts)
    cuts, running, target = [0], 0, 1
    for index, tokens in enumerate(token_counts[:-1]):
        running += tokens
        if target < count and running * count >= target * total:
            cuts.append(index + 1)
            target += 1
    cuts.append(len(token_counts))
    return [range(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


class PipelineSends:
    """Hidden states to the next stage (asynchronous, so the stage computes on) and from
    the previous one (waiting for it: the time counts as communication, the bubble
    included)."""

    def __init__(self, stage: PipelineStage) -> None:
        self.stage = stage
        # (request, tensor): the tensor stays alive until its send completes.
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.wait_seconds = 0.0

    def receive(self, rows: int, hidden_size: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        started = time.perf_counter()
        hidden = torch.empty(rows, hidden_size, dtype=dtype, device=device)
        dist.recv(hidden, self.stage.previous_rank)
        self.wait_seconds += time.perf_counter() - started
        return hidden

    def send(self, hidden: torch.Tensor) -> None:
        hidden = hidden.contiguous()
        self._pending.append((dist.isend(hidden, self.stage.next_rank), hidden))

    def finish(self) -> float:
        """Wait for the sends; the seconds spent waiting since the last finish."""
        started = time.perf_counter()
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        seconds = self.wait_seconds + time.perf_counter() - started
        self.wait_seconds = 0.0
        return seconds
