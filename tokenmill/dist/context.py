"""The tensor-parallel group a worker runs in, over torch.distributed.

Workers are processes: tokenmill launches them itself (executor/multiprocess.py gives
each its rank and a rendezvous port), or torchrun does (RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in the environment are honoured). The backend is gloo on
the CPU and NCCL on CUDA. `GroupCollectives` is what model layers call
(layers/parallel.py's protocol); it also times the collectives, so a step's
communication can be reported apart from its compute.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill.dist.collectives import ALGORITHMS, all_reduce, reduce_scatter

# How long a collective may wait for a peer before the group gives up (a dead worker
# must fail the step, not hang it).
COLLECTIVE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the ranks of one engine find each other."""

    rank: int
    world_size: int
    port: int
    backend: str = "gloo"

    @classmethod
    def from_environment(cls, backend: str) -> Rendezvous | None:
        """torchrun's variables, when they are set."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                   int(os.environ.get("MASTER_PORT", "29500")), backend)


def init_group(rendezvous: Rendezvous) -> None:
    """Join the process group (once per process)."""
    if dist.is_initialized():
        return
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(rendezvous.backend, init_method=f"tcp://{address}:{rendezvous.port}",
                            rank=rendezvous.rank, world_size=rendezvous.world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def stage_group(stage: int, tp: int, pp: int) -> dist.ProcessGroup | None:
    """The tensor-parallel group of ranks [stage * tp, (stage + 1) * tp) (None: the
    whole world, when there is one stage). Every rank creates every stage's group, in
    the same order, as torch.distributed requires."""
    if pp == 1:
        return None
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
    return groups[stage]


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (`device`: where the backend reduces)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


@dataclass
class GroupCollectives:
    """This rank's view of its tensor-parallel group."""

    rank: int
    size: int
    algorithm: str = "backend"
    group: dist.ProcessGroup | None = None
    # Sequence parallelism: ranks hold `chunk` of the step's `tokens` rows each (the
    # last rank's share padded with zero rows), set by split_tokens.
    sequence_parallel: bool = False
    # Expert parallelism: MoE layers hold E / size whole experts each.
    expert_parallel: bool = False
    tokens: int = 0
    chunk: int = 0
    # Seconds spent in collectives since the last take_comm_seconds().
    comm_seconds: float = field(default=0.0)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"all_reduce must be one of {ALGORITHMS}, got {self.algorithm!r}")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        all_reduce(tensor, self.algorithm, self.group)
        self.comm_seconds += time.perf_counter() - started
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        self.comm_seconds += time.perf_counter() - started
        return torch.cat(parts, dim=-1)

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor,
                   output_splits: list[int], input_splits: list[int]) -> None:
        """Rows input_splits[r] of `tensor` to rank r; output_splits[r] rows from it."""
        started = time.perf_counter()
        dist.all_to_all_single(output, tensor.contiguous(), output_splits, input_splits,
                               group=self.group)
        self.comm_seconds += time.perf_counter() - started

    def split_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return hidden
        self.tokens = hidden.shape[0]
        self.chunk = -(-self.tokens // self.size)
        return self._padded(hidden)[self.rank * self.chunk:(self.rank + 1) * self.chunk]

    def gather_tokens(self, local: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return local
        started = time.perf_counter()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        self.comm_seconds += time.perf_counter() - started
        return torch.cat(parts)[:self.tokens]

    def reduce_partial(self, partial: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return self.all_reduce(partial)
        started = time.perf_counter()
        mine = reduce_scatter(self._padded(partial), self.group)
        self.comm_seconds += time.perf_counter() - started
        return mine.view(self.chunk, *partial.shape[1:])

    def _padded(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` [tokens, ...] with zero rows up to chunk * size."""
        missing = self.chunk * self.size - rows.shape[0]
        if not missing:
            return rows
        return torch.cat([rows, rows.new_zeros(missing, *rows.shape[1:])])

    def take_comm_seconds(self) -> float:
        seconds, self.comm_seconds = self.comm_seconds, 0.0
        return seconds
