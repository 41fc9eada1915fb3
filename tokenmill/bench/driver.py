"""Run a workload through an in-process LLMEngine, timing every token.

The driver owns the step loop (instead of LLM.generate) so it can stamp each new
output token with the time its step returned, and cap how many requests are in
flight (closed-loop concurrency: a new request enters when one finishes).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from tokenmill.bench.metrics import RequestRecord
from tokenmill.bench.workload import WorkloadRequest
from tokenmill.engine.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams


@dataclass
class EngineRun:
    records: list[RequestRecord]
    duration_s: float
    num_steps: int
    # Speculative decoding in this run: draft tokens verified, and accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_acceptance(self) -> float | None:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None


def benchmark_params(max_tokens: int) -> SamplingParams:
    """Greedy, exactly max_tokens tokens: every system does the same amount of work."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_engine_workload(engine: LLMEngine, workload: Sequence[WorkloadRequest],
                        max_concurrency: int | None = None, progress: bool = True,
                        desc: str = "requests", id_prefix: str = "bench",
                        cold_prefix_cache: bool = True) -> EngineRun:
    """All requests arrive at t=0 (or as slots free up under max_concurrency).

    cold_prefix_cache: evict cached blocks first, so a repeated run does not reuse the
    KV of an earlier one (prompts repeated within the run still hit).
    """
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine already has requests in flight")
    if cold_prefix_cache:
        engine.kv_manager.reset_prefix_cache()
    limit = max_concurrency or len(workload)
    records: dict[str, RequestRecord] = {}
    seen_tokens: dict[str, int] = {}
    pending = list(enumerate(workload))
    pending.reverse()  # pop() from the end takes them in workload order
    stats = engine.stats
    before = (stats.num_steps, stats.spec_draft_tokens, stats.spec_accepted_tokens)
    start = time.perf_counter()
    in_flight = 0

    def admit() -> None:
        nonlocal in_flight
        while pending and in_flight < limit:
            index, request = pending.pop()
            request_id = f"{id_prefix}-{index}"
            now = time.perf_counter()
            engine.add_request(request_id, request.prompt, benchmark_params(request.max_tokens))
            records[request_id] = RequestRecord(request_id, request.prompt_len, now)
            seen_tokens[request_id] = 0
            in_flight += 1

    with tqdm(total=len(workload), desc=desc, disable=not progress, leave=False) as bar:
        admit()
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for output in outputs:
                record = records[output.request_id]
                produced = len(output.outputs[0].token_ids)
                if produced > seen_tokens[output.request_id]:
                    record.chunk_times.append(now)
                    record.chunk_tokens.append(produced - seen_tokens[output.request_id])
                    seen_tokens[output.request_id] = produced
                if output.finished:
                    record.end_time = now
                    record.success = output.outputs[0].finish_reason != "abort"
                    in_flight -= 1
                    bar.update(1)
            admit()
    duration = time.perf_counter() - start
    ordered = [records[f"{id_prefix}-{i}"] for i in range(len(workload))]
    return EngineRun(ordered, duration, stats.num_steps - before[0],
                     stats.spec_draft_tokens - before[1], stats.spec_accepted_tokens - before[2])


def warm_up(engine: LLMEngine, prompt_len: int = 16, max_tokens: int = 4) -> None:
    """One short request, so lazy initialisation is not timed."""
    vocab = engine.arch.vocab_size
    prompt = [1 + (i * 7919) % (vocab - 1) for i in range(prompt_len)]
    run_engine_workload(engine, [WorkloadRequest(prompt, prompt_len, max_tokens)],
                        progress=False, id_prefix="warmup")
