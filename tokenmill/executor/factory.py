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
    name = config.parallel.executor
    if name == "auto":
        name = "in-process" if config.parallel.world_size == 1 else "multiprocess"
    return EXECUTORS[name](config, progress)
