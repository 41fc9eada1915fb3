"""Executors by name (`--executor`)."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor
from tokenmill.executor.in_process import InProcessExecutor
from tokenmill.executor.multiprocess import MultiprocessExecutor

EXECUTORS: dict[str, type[Executor]] = {
    "in-process": InProcessExecutor,
    "multiprocess": MultiprocessExecutor,
}


def create_executor(config: EngineConfig, progress: bool = True) -> Executor:
    return EXECUTORS[config.parallel.executor](config, progress)
