"""The executor that runs the worker(s) in child processes: one per rank (tensor-parallel
ranks times pipeline stages).

Each child is spawned (a fresh interpreter: nothing of the engine's state is
inherited), joins the ranks' process group (a rendezvous on a free local port), builds
its Worker from the config, and then serves calls over a pipe: each call is (method,
arguments) of plain data and gets one reply, in order. Every call goes to every rank
(they run the same step on their shards, in lockstep through their collectives); the
engine uses the answer of the last pipeline stage's first rank (rank 0 without a
pipeline), which every rank of that stage computes alike. With one worker the
output is token-identical to the in-process executor; with several, to one rank up to
the reassociation of the sums.

A worker that dies (killed, out of memory, a crash in native code) fails the call
that was waiting for it with `WorkerDiedError` instead of hanging the engine; the
ranks left waiting in a collective time out (dist/context.py) and are terminated.
"""

from __future__ import annotations

import logging
import socket
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

import torch.multiprocessing as mp

from tokenmill.config import EngineConfig
from tokenmill.core.step import ProposalRequest, StepInput, StepOutput
from tokenmill.dist.context import Rendezvous
from tokenmill.executor.base import Executor, WorkerDiedError, WorkerInfo

logger = logging.getLogger(__name__)

# How often a waiting call checks that the workers are still alive.
LIVENESS_POLL_S = 0.5
SHUTDOWN_TIMEOUT_S = 10.0


class WorkerError(RuntimeError):
    """An exception in a worker that could not be sent back as itself."""


def _serve(config: EngineConfig, progress: bool, conn: Connection,
           rendezvous: Rendezvous | None) -> None:
    """The child process: build the worker, then answer calls until told to stop."""
    from tokenmill.worker.worker import Worker

    try:
        worker = Worker(config, progress, rendezvous)
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MultiprocessExecutor(Executor):
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        context = mp.get_context("spawn")
        world = config.parallel.world_size
        port = free_port()
        self._conns: list[Connection] = []
        self._processes = []
        for rank in range(world):
            conn, child_conn = context.Pipe()
            rendezvous = Rendezvous(rank, world, port) if world > 1 else None
            process = context.Process(target=_serve, name=f"tokenmill-worker-{rank}",
                                      args=(config, progress, child_conn, rendezvous),
                                      daemon=True)
            process.start()
            child_conn.close()
            self._conns.append(conn)
            self._processes.append(process)
        # Executors dropped without shutdown() still stop their workers.
        weakref.finalize(self, _terminate, list(self._processes))
        # The last stage samples; its ranks agree, as do all ranks without a pipeline.
        self._answering = world - config.parallel.tensor_parallel_size
        self._tp, self._stages = (config.parallel.tensor_parallel_size,
                                  config.parallel.pipeline_parallel_size)
        infos = self._wait_all()
        self.info = infos[self._answering]
        self.rank_memory = tuple(info.memory for info in infos)

    def _call(self, method: str, *args: Any) -> Any:
        return self._call_all(method, *args)[self._answering]

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        if not self._processes:
            raise WorkerDiedError("a worker process exited earlier; the engine must restart")
        try:
            for conn in self._conns:
                conn.send((method, args))
        except OSError:
            self._died()
        return self._wait_all()

    def _wait_all(self) -> list[Any]:
        """Every rank's reply (raising the first error), checking that none died."""
        replies: dict[int, tuple[str, Any]] = {}
        try:
            while len(replies) < len(self._conns):
                pending = [c for i, c in enumerate(self._conns) if i not in replies]
                for conn in wait(pending, timeout=LIVENESS_POLL_S):
                    replies[self._conns.index(conn)] = conn.recv()
                if any(not p.is_alive() for p in self._processes) and \
                        len(replies) < len(self._conns):
                    self._died()
        except (EOFError, OSError):
            self._died()
        errors = [payload for status, payload in replies.values() if status == "error"]
        if errors:
            raise errors[0]
        return [replies[i][1] for i in range(len(self._conns))]

    def _died(self) -> NoReturn:
        processes, self._processes = self._processes, []
        codes = []
        for process in processes:
            if process.is_alive():
                process.terminate()  # the others would wait on their dead peer
            process.join(SHUTDOWN_TIMEOUT_S)
            codes.append(process.exitcode)
        raise WorkerDiedError(f"a worker process exited (exit codes {codes})")

    def execute(self, step: StepInput) -> StepOutput:
        replies = self._call_all("execute", step)
        output = replies[self._answering]
        if self._stages > 1:  # each stage routed its own layers' tokens, in stage order
            output.expert_load = [layer for stage in replies[::self._tp] if stage is not None
                                  for layer in stage.expert_load]
        return output

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        return self._call("propose", requests)

    def release(self, request_ids: list[str]) -> None:
        self._call("release", request_ids)

    def check_integrity(self, idle: bool = False) -> None:
        self._call("check_integrity", idle)

    def shutdown(self) -> None:
        processes, self._processes = self._processes, []
        for conn in self._conns:
            try:
                conn.send(("shutdown", ()))
            except (BrokenPipeError, EOFError, OSError):
                pass
        for process in processes:
            process.join(SHUTDOWN_TIMEOUT_S)
            if process.is_alive():
                logger.warning("worker %s did not stop in %.0f s; terminating it",
                               process.name, SHUTDOWN_TIMEOUT_S)
                process.terminate()
                process.join()
        for conn in self._conns:
            conn.close()


def _terminate(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(SHUTDOWN_TIMEOUT_S)
