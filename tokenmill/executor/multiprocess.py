"""The executor that runs the worker in a child process.

The child is spawned (a fresh interpreter: nothing of the engine's state is
inherited), builds its Worker from the config, and then serves calls over a pipe:
each call is (method, arguments) of plain data and gets one reply, in order. This is
the path tensor and pipeline parallelism will take with several workers; with one
worker its output is token-identical to the in-process executor.

A worker that dies (killed, out of memory, a crash in native code) fails the call
that was waiting for it with `WorkerDiedError` instead of hanging the engine.
"""

from __future__ import annotations

import logging
import traceback
import weakref
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import torch.multiprocessing as mp

from tokenmill.config import EngineConfig
from tokenmill.core.step import ProposalRequest, StepInput, StepOutput
from tokenmill.executor.base import Executor, WorkerDiedError, WorkerInfo

logger = logging.getLogger(__name__)

# How often a waiting call checks that the worker is still alive.
LIVENESS_POLL_S = 0.5
SHUTDOWN_TIMEOUT_S = 10.0


class WorkerError(RuntimeError):
    """An exception in the worker that could not be sent back as itself."""


def _serve(config: EngineConfig, progress: bool, conn: Connection) -> None:
    """The child process: build the worker, then answer calls until told to stop."""
    from tokenmill.worker.worker import Worker

    try:
        worker = Worker(config, progress)
        _reply(conn, "ok", WorkerInfo.of(worker))
    except BaseException as exc:  # noqa: BLE001 (reported to the engine, which raises it)
        _reply(conn, "error", exc)
        return
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return  # the engine went away
        if method == "shutdown":
            _reply(conn, "ok", None)
            return
        try:
            result = getattr(worker, method)(*args)
        except BaseException as exc:  # noqa: BLE001
            _reply(conn, "error", exc)
        else:
            _reply(conn, "ok", result)


def _reply(conn: Connection, status: str, payload: Any) -> None:
    try:
        conn.send((status, payload))
    except Exception:  # noqa: BLE001 (an unpicklable exception: send its text)
        text = "".join(traceback.format_exception(payload)) if status == "error" else ""
        conn.send(("error", WorkerError(text or f"unpicklable reply {payload!r}")))


class MultiprocessExecutor(Executor):
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        context = mp.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_serve, args=(config, progress, child_conn),
                                        name="tokenmill-worker", daemon=True)
        self._process.start()
        child_conn.close()
        # An executor dropped without shutdown() still stops its worker.
        weakref.finalize(self, _terminate, self._process)
        self.info = self._wait()

    def _call(self, method: str, *args: Any) -> Any:
        if self._process is None:
            raise WorkerDiedError("the worker process exited earlier; the engine must restart")
        try:
            self._conn.send((method, args))
        except OSError:
            self._died()
        return self._wait()

    def _wait(self) -> Any:
        try:
            while not self._conn.poll(LIVENESS_POLL_S):
                if not self._process.is_alive():
                    self._died()
            status, payload = self._conn.recv()
        except (EOFError, OSError):
            self._died()
        if status == "error":
            raise payload
        return payload

    def _died(self) -> NoReturn:
        process, self._process = self._process, None
        process.join(LIVENESS_POLL_S)
        raise WorkerDiedError(f"the worker process exited (code {process.exitcode})")

    def execute(self, step: StepInput) -> StepOutput:
        return self._call("execute", step)

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        return self._call("propose", requests)

    def release(self, request_ids: list[str]) -> None:
        self._call("release", request_ids)

    def check_integrity(self, idle: bool = False) -> None:
        self._call("check_integrity", idle)

    def shutdown(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            self._conn.send(("shutdown", ()))
            self._conn.poll(SHUTDOWN_TIMEOUT_S)
        except (BrokenPipeError, EOFError, OSError):
            pass
        process.join(SHUTDOWN_TIMEOUT_S)
        if process.is_alive():
            logger.warning("the worker did not stop in %.0f s; terminating it",
                           SHUTDOWN_TIMEOUT_S)
            process.terminate()
            process.join()
        self._conn.close()


def _terminate(process) -> None:
    if process.is_alive():
        process.terminate()
        process.join(SHUTDOWN_TIMEOUT_S)
