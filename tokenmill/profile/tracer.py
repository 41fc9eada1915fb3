"""StepTracer: where each engine step's time goes, as Chrome/Perfetto trace JSON.

The engine and its worker call the tracer at phase boundaries when one is attached
(`engine.tracer` and, through the executor, the worker's; None by default):

    begin_step()                      step starts
    scheduled(sched, running, waiting)  end of "schedule"; records the batch composition
    mark("prepare_inputs")            end of input preparation (worker)
    mark("forward")                   end of the model forward (worker)
    mark("logits")                    end of the LM head / prompt logprobs (worker)
    mark("sample")                    end of sampling (worker)
    end_step()                        end of "output" (request updates, detokenisation)

Each mark closes the phase that began at the previous boundary, so a step's phases
tile it exactly. The time between one step's end and the next step's start is
"idle" (waiting for work, or the caller's own loop). Optionally the first N steps
run under torch.profiler, exported as a separate Chrome trace.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ProfileError(RuntimeError):
    """Profiling cannot be done as asked (e.g. a profile is already running)."""


# transfer: sending the step to a worker in another process and its answer back.
PHASES = ("schedule", "transfer", "prepare_inputs", "forward", "logits", "sample", "output")
COMPUTE_PHASES = frozenset({"forward", "logits"})


@dataclass
class StepRecord:
    index: int
    start: float
    end: float = 0.0
    # (phase, start, end), in order; they tile [start, end].
    phases: list[tuple[str, float, float]] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    # Seconds after the step spent stopping/exporting torch.profiler: not idle time.
    pause_after: float = 0.0
    # Of the forward, seconds in tensor-parallel collectives (reported by the worker).
    communication_s: float = 0.0


class StepTracer:
    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 sync: Callable[[], None] | None = None, torch_profile_steps: int = 0,
                 torch_trace_path: str | Path | None = None) -> None:
        self.clock = clock
        # Called before timing the end of the forward (torch.cuda.synchronize on GPU),
        # so asynchronous kernels are charged to the forward, not to a later phase.
        self.sync = sync
        self.steps: list[StepRecord] = []
        self._current: StepRecord | None = None
        self._last_boundary = 0.0
        self.torch_profile_steps = torch_profile_steps
        self.torch_trace_path = torch_trace_path
        self._torch_profiler: Any = None

    # ---- attaching ------------------------------------------------------------------------
    def attach(self, engine) -> StepTracer:
        """Trace `engine`'s steps (a worker in another process reports its phases with
        each step's output); ProfileError when a tracer is attached already."""
        if engine.tracer is not None:
            raise ProfileError("a profile is already running on this engine")
        engine.executor.set_tracer(self)
        engine.tracer = self
        if engine.speculation is not None:
            engine.speculation.tracer = self
        if self.sync is None and engine.info.device_type == "cuda":
            import torch

            self.sync = torch.cuda.synchronize
        return self

    def detach(self, engine) -> None:
        engine.tracer = None
        engine.executor.set_tracer(None)
        if engine.speculation is not None:
            engine.speculation.tracer = None
        self._stop_torch_profiler()

    # ---- called by the engine and runner -------------------------------------------------------
    def begin_step(self) -> None:
        now = self.clock()
        self._current = StepRecord(len(self.steps), now)
        self._last_boundary = now
        if self.torch_profile_steps and not self.steps and self._torch_profiler is None:
            self._start_torch_profiler()

    def scheduled(self, sched, num_running: int, num_waiting: int) -> None:
        step = self._current
        if step is None:
            return
        for request, num_new in sched.scheduled:
            if num_new == 1 and request.num_computed_tokens > 0:
                step.decode_tokens += 1
            else:
                step.prefill_tokens += num_new
        step.num_running = num_running
        step.num_waiting = num_waiting
        self.mark("schedule")

    def mark(self, phase: str) -> None:
        step = self._current
        if step is None:  # attached mid-step: the step is not recorded
            return
        if phase == "forward" and self.sync is not None:
            self.sync()
        now = self.clock()
        step.phases.append((phase, self._last_boundary, now))
        self._last_boundary = now

    def worker_step(self, phase_seconds: dict[str, float]) -> None:
        """The worker's own account of the step just executed (StepOutput.phase_seconds):
        its time in collectives, and, when the worker runs in another process (no phase
        was marked live), its phases, laid out to end now after the transfer."""
        step = self._current
        if step is None:
            return
        step.communication_s += phase_seconds.get("communication", 0.0)
        if any(name == "forward" for name, _, _ in step.phases):
            return  # marked live, in this process
        now = self.clock()
        worker = [(name, phase_seconds[name]) for name in ("prepare_inputs", "forward", "sample")
                  if name in phase_seconds]
        start = max(self._last_boundary, now - sum(seconds for _, seconds in worker))
        if start > self._last_boundary:
            step.phases.append(("transfer", self._last_boundary, start))
        for index, (name, seconds) in enumerate(worker):
            end = now if index == len(worker) - 1 else min(start + seconds, now)
            step.phases.append((name, start, end))
            start = end
        self._last_boundary = now

    def end_step(self) -> None:
        step = self._current
        if step is None:
            return
        self.mark("output")
        step.end = self._last_boundary
        self.steps.append(step)
        self._current = None
        if self._torch_profiler is not None:
            self._torch_profiler.step()
            if len(self.steps) >= self.torch_profile_steps:
                self._stop_torch_profiler()
                step.pause_after = self.clock() - step.end

    # ---- torch.profiler --------------------------------------------------------------------
    def _start_torch_profiler(self) -> None:
        import torch

        self._torch_profiler = torch.profiler.profile(record_shapes=True)
        self._torch_profiler.__enter__()

    def _stop_torch_profiler(self) -> None:
        profiler, self._torch_profiler = self._torch_profiler, None
        if profiler is None:
            return
        profiler.__exit__(None, None, None)
        if self.torch_trace_path is not None:
            profiler.export_chrome_trace(str(self.torch_trace_path))

    # ---- results -------------------------------------------------------------------------------
    def chrome_trace(self) -> dict:
        """Trace Event Format: a step span with its phase spans nested, plus counters."""
        events: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "tokenmill engine"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "steps"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2,
             "args": {"name": "communication (inside the forward)"}}]
        if not self.steps:
            return {"traceEvents": events, "displayTimeUnit": "ms"}
        origin = self.steps[0].start

        def us(t: float) -> float:
            return round((t - origin) * 1e6, 3)

        previous_end = None
        for step in self.steps:
            if previous_end is not None and step.start > previous_end:
                events.append({"name": "idle", "cat": "idle", "ph": "X", "pid": 1, "tid": 1,
                               "ts": us(previous_end), "dur": us(step.start) - us(previous_end)})
            previous_end = step.end + step.pause_after
            if step.pause_after:
                events.append({"name": "torch.profiler export", "cat": "profiler", "ph": "X",
                               "pid": 1, "tid": 1, "ts": us(step.end),
                               "dur": us(previous_end) - us(step.end)})
            args = {"step": step.index, "prefill_tokens": step.prefill_tokens,
                    "decode_tokens": step.decode_tokens, "running": step.num_running,
                    "waiting": step.num_waiting}
            events.append({"name": f"step {step.index}", "cat": "step", "ph": "X", "pid": 1,
                           "tid": 1, "ts": us(step.start), "dur": us(step.end) - us(step.start),
                           "args": args})
            for phase, start, end in step.phases:
                events.append({"name": phase, "cat": "phase", "ph": "X", "pid": 1, "tid": 1,
                               "ts": us(start), "dur": us(end) - us(start),
                               "args": {"step": step.index}})
                if phase == "forward" and step.communication_s:
                    # The collectives are spread through the forward; their total is
                    # drawn from its start, on a lane of its own.
                    events.append({"name": "collectives / pipeline receive", "cat": "communication",
                                   "ph": "X", "pid": 1, "tid": 2, "ts": us(start),
                                   "dur": round(step.communication_s * 1e6, 3),
                                   "args": {"step": step.index}})
            events.append({"name": "batch", "ph": "C", "pid": 1, "ts": us(step.start),
                           "args": {"prefill_tokens": step.prefill_tokens,
                                    "decode_tokens": step.decode_tokens}})
            events.append({"name": "queue", "ph": "C", "pid": 1, "ts": us(step.start),
                           "args": {"running": step.num_running, "waiting": step.num_waiting}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.chrome_trace()))
        return path
