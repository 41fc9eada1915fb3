"""The executor that runs the worker in the engine's own process: every call is a
plain method call, the step data is passed by reference."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.core.step import ProposalRequest, StepInput, StepOutput
from tokenmill.executor.base import Executor, WorkerInfo
from tokenmill.worker.worker import Worker


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.worker = Worker(config, progress)
        self.info = WorkerInfo.of(self.worker)

    def execute(self, step: StepInput) -> StepOutput:
        return self.worker.execute(step)

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        return self.worker.propose(requests)

    def release(self, request_ids: list[str]) -> None:
        self.worker.release(request_ids)

    def check_integrity(self, idle: bool = False) -> None:
        self.worker.check_integrity(idle)

    def set_tracer(self, tracer) -> None:
        self.worker.set_tracer(tracer)
