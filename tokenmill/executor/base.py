"""The executor interface: how the engine reaches the worker(s) that hold the model.

Everything crossing it is plain data (tokenmill.core.step), so the in-process
executor and one that runs workers in child processes are interchangeable; tensor
and pipeline parallelism will be executors with several workers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from tokenmill.core.step import ProposalRequest, StepInput, StepOutput
from tokenmill.model.arch import ArchConfig
from tokenmill.worker.memory import KVPlan
from tokenmill.worker.worker import MemoryUsage, Worker

# Rows whose padding the engine's speculation controller looks up (its steps never
# exceed the token budget; beyond the table a row count is its own).
PADDED_ROWS_TABLE = 2048


@dataclass(frozen=True)
class WorkerInfo:
    """What the engine needs to know of the worker, once, at start-up."""

    arch: ArchConfig
    max_model_len: int
    kv_plan: KVPlan
    generation_config: dict[str, Any]
    device_type: str
    dtype_itemsize: int
    memory: MemoryUsage
    # Rows the products compute for a product of n rows (index n; padding included).
    padded_rows: tuple[int, ...]
    has_proposer: bool
    needs_hidden_states: bool

    @classmethod
    def of(cls, worker: Worker) -> WorkerInfo:
        table = tuple(worker.products.padded_rows(n) for n in range(PADDED_ROWS_TABLE + 1))
        return cls(worker.arch, worker.max_model_len, worker.kv_plan, worker.generation_config,
                   worker.device.type, worker.dtype.itemsize, worker.memory, table,
                   worker.proposer is not None, worker.needs_hidden_states)

    def padded(self, num_rows: int) -> int:
        return self.padded_rows[num_rows] if num_rows < len(self.padded_rows) else num_rows


class WorkerDiedError(RuntimeError):
    """A worker process exited while the engine needed it: the engine cannot go on."""


class Executor(ABC):
    info: WorkerInfo

    @abstractmethod
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step on the worker(s)."""

    @abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """Draft tokens for these requests (speculative decoding)."""

    @abstractmethod
    def release(self, request_ids: list[str]) -> None:
        """These requests finished: the worker(s) drop what they keep for them."""

    @abstractmethod
    def check_integrity(self, idle: bool = False) -> None:
        """The worker-side cache structures (idle: no request holds any state)."""

    def set_tracer(self, tracer) -> None:
        """Mark the worker's step phases on a StepTracer live (None: stop). Executors
        whose workers run elsewhere leave this alone: the phases reach the tracer
        through StepOutput.phase_seconds."""
        return None

    def shutdown(self) -> None:
        """Stop the worker(s); the executor is unusable afterwards."""
        return None
