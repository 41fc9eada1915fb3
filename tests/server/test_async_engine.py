"""AsyncLLMEngine on its own: streams, abort, admission control, shutdown, idling."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenmill.engine.async_engine import (
    AsyncLLMEngine,
    EngineStoppedError,
    QueueFullError,
    RequestStream,
)
from tokenmill.engine.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def engine(llama_dir) -> LLMEngine:
    return LLMEngine.from_kwargs(str(llama_dir), progress=False, max_num_seqs=4)


def run(engine: LLMEngine, scenario, max_queue: int = 8, stream_interval: int = 1):
    async def main():
        async_engine = AsyncLLMEngine(engine, max_queue=max_queue, check_integrity_when_idle=True,
                                      stream_interval=stream_interval)
        async_engine.start()
        try:
            return await scenario(async_engine)
        finally:
            await async_engine.shutdown(0.5)

    return asyncio.run(main())


def test_stream_is_cumulative_and_matches_the_sync_engine(engine):
    ids = engine.encode("def add(a, b):")
    engine.add_request("sync", ids, GREEDY)
    expected = engine.run_to_completion()["sync"].outputs[0]

    async def scenario(async_engine):
        return [out async for out in async_engine.generate("async", ids, GREEDY)]

    outputs = run(engine, scenario)
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(lengths)
    assert outputs[-1].outputs[0].token_ids == expected.token_ids
    assert outputs[-1].outputs[0].text == expected.text


@pytest.mark.parametrize("interval, expected", [(1, list(range(1, 11))), (4, [1, 5, 9, 10]),
                                                (32, [1, 10])])
def test_stream_interval_sends_the_first_token_then_every_n_and_the_last(
        engine, monkeypatch, interval, expected):
    ids = engine.encode("def add(a, b):")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("sync", ids, params)
    reference = engine.run_to_completion()["sync"].outputs[0]
    delivered: list[int] = []
    deliver = RequestStream.deliver

    def recording(self, item):
        delivered.append(len(item.outputs[0].token_ids))
        deliver(self, item)

    monkeypatch.setattr(RequestStream, "deliver", recording)

    async def scenario(async_engine):
        return [out async for out in async_engine.generate("s", ids, params)]

    outputs = run(engine, scenario, stream_interval=interval)
    assert delivered == expected
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == reference.token_ids
    assert outputs[-1].outputs[0].text == reference.text
    with pytest.raises(ValueError, match="stream_interval"):
        AsyncLLMEngine(engine, stream_interval=0)


def test_leaving_a_stream_early_aborts_and_frees_blocks(engine):
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def scenario(async_engine):
        async for _ in async_engine.generate("leaver", [1, 2, 3], long):
            break
        deadline = time.monotonic() + 10
        while async_engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        return async_engine.num_in_flight, async_engine.snapshot

    in_flight, snapshot = run(engine, scenario)
    assert in_flight == 0
    assert snapshot.kv_cache_usage == 0.0 and snapshot.num_aborted_requests == 1
    engine.check_integrity()


def test_admission_control_rejects_beyond_capacity(engine):
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def scenario(async_engine):
        # max_num_seqs=4 plus max_queue=2: six sequences fit.
        streams = [async_engine.add_request(f"r{i}", [1, 2, 3], long) for i in range(3)]
        streams.append(async_engine.add_request("pair", [1, 2], SamplingParams(
            n=3, temperature=0.0, max_tokens=60, ignore_eos=True)))
        with pytest.raises(QueueFullError):
            async_engine.add_request("over", [1, 2, 3], long)
        finals = []
        for stream in streams:
            async for out in stream:
                final = out
            finals.append(final)
        # Room again once they finished.
        late = [o async for o in async_engine.generate("late", [1, 2], GREEDY)]
        return finals, late

    finals, late = run(engine, scenario, max_queue=2)
    assert all(len(c.token_ids) == 60 for f in finals for c in f.outputs)
    assert late[-1].finished


def test_invalid_request_fails_only_its_stream(engine):
    async def scenario(async_engine):
        bad = async_engine.add_request("bad", [10**6], GREEDY)
        with pytest.raises(ValueError, match="prompt token ids"):
            async for _ in bad:
                pass
        return [o async for o in async_engine.generate("good", [1, 2], GREEDY)]

    outputs = run(engine, scenario)
    assert outputs[-1].finished


def test_shutdown_aborts_after_grace_and_refuses_new_requests(engine):
    long = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)

    async def scenario(async_engine):
        stream = async_engine.add_request("slow", [1, 2, 3], long)
        first = await stream.__anext__()
        started = time.monotonic()
        await async_engine.shutdown(0.2)
        elapsed = time.monotonic() - started
        # Past the grace the request ends with an error its client sees (a 503, or a
        # stream's error event), not a silent "abort".
        with pytest.raises(EngineStoppedError, match="shut down before"):
            async for _ in stream:
                pass
        with pytest.raises(EngineStoppedError):
            async_engine.add_request("after", [1], GREEDY)
        return elapsed, first

    elapsed, first = run(engine, scenario)
    assert elapsed < 5
    assert not first.finished
    assert engine.kv_manager.usage == 0.0


def test_idle_loop_blocks_instead_of_spinning(engine, monkeypatch):
    calls = {"steps": 0, "checks": 0}
    original_step = engine.step
    original_has = engine.has_unfinished_requests

    def counting_step():
        calls["steps"] += 1
        return original_step()

    def counting_has():
        calls["checks"] += 1
        return original_has()

    monkeypatch.setattr(engine, "step", counting_step)
    monkeypatch.setattr(engine, "has_unfinished_requests", counting_has)

    async def scenario(async_engine):
        await asyncio.sleep(0.5)
        return dict(calls)

    idle = run(engine, scenario)
    assert idle["steps"] == 0
    assert idle["checks"] <= 3


def test_failure_while_scheduling_fails_the_waiting_requests(engine, monkeypatch):
    original = engine.scheduler.schedule
    calls = {"n": 0}

    def flaky_schedule():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return original()

    monkeypatch.setattr(engine.scheduler, "schedule", flaky_schedule)

    async def scenario(async_engine):
        with pytest.raises(RuntimeError, match="injected failure"):
            async for _ in async_engine.generate("first", [1, 2], GREEDY):
                pass
        return [o async for o in async_engine.generate("second", [1, 2], GREEDY)]

    outputs = run(engine, scenario)
    assert outputs[-1].finished
    engine.check_integrity()
