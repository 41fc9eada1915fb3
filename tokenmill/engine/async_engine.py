"""AsyncLLMEngine: the synchronous engine driven by a background thread, with one
asyncio output stream per request.

The engine is not thread-safe, so one thread (the loop thread) owns it: every add,
abort and step happens there, fed by a thread-safe command queue. Outputs travel back
to the event loop that created each request through `loop.call_soon_threadsafe`.
When the engine has nothing to do the loop thread blocks on the command queue.

Streaming interval (`stream_interval`, the server's `--stream-interval`, as vLLM's):
a request's first output goes out at once, then one whenever it has produced that many
more tokens (summed over its completions), and its last one; outputs are cumulative,
so a client sees every token, in fewer, larger pieces. Each delivery costs the server a
wake-up, a chunk to shape and a write, and the client a read: on a 2-core host those
compete with the engine for the cores (docs/BENCHMARKS.md, server overhead).

Admission control: at most `max_num_seqs + max_queue` sequences (a request with n
completions counts n) are in flight; beyond that `add_request` raises QueueFullError
at once, which the server turns into 429 with Retry-After.

Failures stay local: a request the engine rejects or fails ends its own stream with
the exception. When a step fails, the engine reruns its requests one at a time and
fails only those that fail alone (RequestOutput.error); if the step still raises, the
requests running in it fail and the loop keeps serving the rest. A worker process
that dies stops the loop: every request fails with EngineStoppedError.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.snapshot import EngineSnapshot
from tokenmill.executor.base import WorkerDiedError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The engine admits no more requests right now; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineStoppedError(RuntimeError):
    """The engine is shutting down (or its loop died) and takes no new requests."""


class RequestFailedError(RuntimeError):
    """The engine failed while serving this request."""


class RequestStream:
    """Async iterator over one request's outputs (cumulative RequestOutputs).

    When the consumer falls behind, queued outputs are coalesced into the latest one
    (they are cumulative, so nothing is lost). Ending iteration early, or `cancel()`,
    aborts the request in the engine.
    """

    def __init__(self, request_id: str, owner: AsyncLLMEngine,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    # Called on the loop thread.
    def deliver(self, item: RequestOutput | BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed; nobody is listening
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            self.cancel()
            raise
        while not isinstance(item, BaseException) and not item.finished:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                break
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def cancel(self) -> None:
        """Abort the request unless it already finished; safe to call repeatedly."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: RequestStream
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stop:
    pass


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_queue: int = 64,
                 check_integrity_when_idle: bool = False, stream_interval: int = 1) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue!r}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval!r}")
        self.engine = engine
        self.max_queue = max_queue
        self.stream_interval = stream_interval
        self.capacity = engine.config.scheduler.max_num_seqs + max_queue
        # Run the engine's invariant checks each time the loop runs dry (tests).
        self.check_integrity_when_idle = check_integrity_when_idle
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        # Owned by the loop thread: request id -> (stream, sequences, tokens delivered).
        self._streams: dict[str, tuple[RequestStream, int, int]] = {}
        # Sequences admitted and not yet finished; guarded by _lock.
        self._lock = threading.Lock()
        self._in_flight = 0
        self.accepting = True
        self.dead_error: BaseException | None = None
        self.snapshot = EngineSnapshot()
        self._num_aborted = 0  # loop thread only
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)

    # ---- caller side (any thread) -------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.dead_error is None

    def start(self) -> None:
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams
                    ) -> RequestStream:
        """Queue a request; call from the event loop that will read the stream.

        Raises QueueFullError when admission control rejects it and EngineStoppedError
        while shutting down. Validation errors arrive through the stream as ValueError.
        """
        if not self.accepting or self.dead_error is not None:
            raise EngineStoppedError("the server is shutting down")
        if params.n > self.capacity:
            raise ValueError(f"n ({params.n}) is more sequences than this server admits at once "
                             f"({self.capacity}: max_num_seqs + max_queue)")
        with self._lock:
            if self._in_flight + params.n > self.capacity:
                raise QueueFullError(
                    f"the server is at capacity ({self.capacity} sequences in flight); "
                    "retry later")
            self._in_flight += params.n
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        self._commands.put(_Add(request_id, prompt, params, stream, time.monotonic()))
        return stream

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        """Add a request (on first iteration) and yield its outputs; leaving early aborts it."""
        stream = self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.cancel()

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for grace_s, abort the rest."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self._in_flight and time.monotonic() < deadline and self.is_alive:
            await asyncio.sleep(0.02)
        if self._in_flight:
            logger.warning("aborting %d in-flight sequences at shutdown", self._in_flight)
        self._commands.put(_Stop())
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 30.0)
        self.engine.shutdown()

    # ---- loop thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if idle and self.check_integrity_when_idle:
                    self.engine.check_integrity()
                if not self._handle_commands(block=idle):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish_snapshot()
            self._fail_all(EngineStoppedError("the engine stopped"))
        except BaseException as exc:  # a bug in the loop itself: fail everyone, stop
            logger.exception("engine loop died")
            self.dead_error = exc
            self._fail_all(EngineStoppedError(f"engine loop died: {exc!r}"))
        self._publish_snapshot()

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands; returns False once a stop command has been handled."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_id)
            else:
                # Shutting down past the grace period: every request still in flight
                # ends with an error its client sees (a 503, or a stream's error event).
                error = EngineStoppedError("the server shut down before this request "
                                           "finished")
                for request_id in list(self._streams):
                    self._num_aborted += 1
                    self._fail(request_id, error)
                return False

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    arrival_time=command.arrival_time)
        except Exception as exc:  # ValueError for invalid input; anything else is ours
            self._release(command.params.n)
            if not isinstance(exc, ValueError):
                logger.exception("adding request %s failed", command.request_id)
                exc = RequestFailedError(f"the engine failed to add the request: {exc!r}")
            command.stream.deliver(exc)
            return
        self._streams[command.request_id] = (command.stream, command.params.n, 0)

    def _abort(self, request_id: str) -> None:
        if request_id not in self._streams:
            return
        self._num_aborted += 1
        try:
            output = self.engine.abort_request(request_id)
        except Exception as exc:
            logger.exception("aborting request %s failed", request_id)
            self._fail(request_id, RequestFailedError(f"abort failed: {exc!r}"))
            return
        if output is not None:
            self._deliver(output)
        else:
            self._fail(request_id, RequestFailedError("the request vanished from the engine"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except WorkerDiedError:
            raise  # no step can run any more: the loop fails everyone and stops
        except Exception as exc:
            logger.exception("engine step failed; failing the requests running in it")
            error = RequestFailedError(f"the engine failed while running this request: {exc!r}")
            victims = {r.group_id for r in self.engine.scheduler.running}
            if not victims:
                # It failed before anything ran (while scheduling): fail everything
                # unfinished, or the loop would retry the same failure forever.
                victims = set(self.engine.groups)
            for request_id in victims:
                self._fail(request_id, error)
            return
        for output in outputs:
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        entry = self._streams.get(output.request_id)
        if entry is None:
            return
        if output.error is not None and output.finished:
            # The engine failed this request alone (the others of its step went on).
            del self._streams[output.request_id]
            entry[0].deliver(RequestFailedError(output.error))
            self._release(entry[1])
            return
        if not output.finished and self.stream_interval > 1:
            produced = sum(len(choice.token_ids) for choice in output.outputs)
            if entry[2] and produced - entry[2] < self.stream_interval:
                return  # the next delivery carries these tokens too
            self._streams[output.request_id] = (entry[0], entry[1], produced)
        entry[0].deliver(output)
        if output.finished:
            del self._streams[output.request_id]
            self._release(entry[1])

    def _fail(self, request_id: str, error: BaseException) -> None:
        """End a request's stream with an error and drop it from the engine."""
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("could not abort failed request %s", request_id)
            self.engine.groups.pop(request_id, None)
        entry = self._streams.pop(request_id, None)
        if entry is not None:
            entry[0].deliver(error)
            self._release(entry[1])

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._fail(request_id, error)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._release(command.params.n)
                command.stream.deliver(error)

    def _release(self, num_seqs: int) -> None:
        with self._lock:
            self._in_flight -= num_seqs

    def _publish_snapshot(self) -> None:
        kv = self.engine.kv_manager
        stats = self.engine.stats
        self.snapshot = EngineSnapshot(
            num_running=len(self.engine.scheduler.running),
            num_waiting=len(self.engine.scheduler.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_preemptions=self.engine.scheduler.num_preemptions,
            num_aborted_requests=self._num_aborted,
            spec_draft_tokens=stats.spec_draft_tokens,
            spec_accepted_tokens=stats.spec_accepted_tokens,
            spec_verifications=stats.spec_verifications,
            spec_accepted_by_position=tuple(stats.spec_accepted_by_position),
            sparse_attention_by_layer=tuple((*key, keys, queries) for key, (keys, queries)
                                            in sorted(stats.sparse_attention_by_layer.items())),
            **self._expert_snapshot())

    def _expert_snapshot(self) -> dict:
        load = self.engine.expert_load
        if not load.totals:
            return {}
        now, ranks = time.monotonic(), self.engine.rank_load
        return {"expert_tokens": tuple(tuple(layer) for layer in load.totals),
                "expert_imbalance": tuple(load.imbalance(now)),
                "rank_imbalance": tuple(ranks.imbalance(now)) if ranks.totals else ()}
