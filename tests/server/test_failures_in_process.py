"""In-process app (httpx ASGI transport): an engine failure in one request is a 500 for
that request only, and the next request is served."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.engine import LLMEngine
from tokenmill.server.app import build_app

MODEL = "tiny"
REQUEST = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 5, "temperature": 0}


@pytest.fixture(scope="module")
def engine(llama_dir) -> LLMEngine:
    return LLMEngine.from_kwargs(str(llama_dir), progress=False)


def run_with_app(engine: LLMEngine, scenario) -> object:
    async def main():
        async_engine = AsyncLLMEngine(engine)
        async_engine.start()
        transport = httpx.ASGITransport(app=build_app(async_engine, MODEL))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://app",
                                         timeout=30) as client:
                return await scenario(client, async_engine)
        finally:
            await async_engine.shutdown(1.0)

    return asyncio.run(main())


def fail_once(monkeypatch, obj, name: str) -> None:
    original = getattr(obj, name)
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, flaky)


def assert_engine_error(response: httpx.Response) -> None:
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and "injected failure" in error["message"]


def test_failed_step_is_a_500_and_the_next_request_succeeds(engine, monkeypatch):
    fail_once(monkeypatch, engine.executor, "execute")

    async def scenario(client, async_engine):
        first = await client.post("/v1/completions", json=REQUEST)
        second = await client.post("/v1/completions", json=REQUEST)
        return first, second

    first, second = run_with_app(engine, scenario)
    assert_engine_error(first)
    assert second.status_code == 200
    assert second.json()["usage"]["completion_tokens"] == 5
    assert engine.kv_manager.usage == 0.0
    engine.check_integrity()


def test_failed_add_is_a_500_and_the_next_request_succeeds(engine, monkeypatch):
    fail_once(monkeypatch, engine, "add_request")

    async def scenario(client, async_engine):
        first = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        second = await client.post("/v1/completions", json=REQUEST)
        return first, second

    first, second = run_with_app(engine, scenario)
    assert_engine_error(first)
    assert second.status_code == 200


def test_failure_mid_stream_ends_the_stream_with_an_error_event(engine, monkeypatch):
    original = engine.executor.execute
    calls = {"n": 0}

    def fail_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.executor, "execute", fail_third)

    async def scenario(client, async_engine):
        response = await client.post("/v1/completions", json={**REQUEST, "stream": True,
                                                              "max_tokens": 10})
        events = [line[5:].strip() for line in response.text.splitlines()
                  if line.startswith("data:")]
        after = await client.post("/v1/completions", json=REQUEST)
        return events, after

    events, after = run_with_app(engine, scenario)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "injected failure" in error["message"]
    assert after.status_code == 200
    assert engine.kv_manager.usage == 0.0


def test_failure_in_one_request_leaves_concurrent_ones_alone(engine, monkeypatch):
    """add_request fails for one request while another is being generated."""
    original = engine.add_request

    def reject_poisoned(request_id, prompt, params, arrival_time=None):
        if params.max_tokens == 7:
            raise RuntimeError("injected failure")
        return original(request_id, prompt, params, arrival_time=arrival_time)

    monkeypatch.setattr(engine, "add_request", reject_poisoned)

    async def scenario(client, async_engine):
        healthy = client.post("/v1/completions", json={**REQUEST, "max_tokens": 40,
                                                       "ignore_eos": True})
        poisoned = client.post("/v1/completions", json={**REQUEST, "max_tokens": 7})
        return await asyncio.gather(healthy, poisoned)

    healthy, poisoned = run_with_app(engine, scenario)
    assert healthy.status_code == 200
    assert healthy.json()["usage"]["completion_tokens"] == 40
    assert_engine_error(poisoned)


def test_shutting_down_answers_503_with_retry_after(engine):
    async def scenario(client, async_engine):
        await async_engine.shutdown(0.0)
        return (await client.post("/v1/completions", json=REQUEST),
                await client.get("/health"))

    refused, health = run_with_app(engine, scenario)
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["type"] == "service_unavailable_error"
    assert health.status_code == 503


def test_api_key_comes_from_the_argument_then_the_environment(monkeypatch):
    from tokenmill.server.serve import API_KEY_ENV, resolve_api_key

    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key("given") == "given"
    assert resolve_api_key(None) == "from-env"
    monkeypatch.delenv(API_KEY_ENV)
    assert resolve_api_key(None) is None


def test_health_answers_while_a_huge_prompt_is_tokenized(engine):
    """Prompts are tokenized on the server's input threads, not on the event loop: a
    multi-megabyte prompt (too long for the context: a 400 in the end) does not hold
    up /health meanwhile."""
    huge = "def add(a, b):\n    return a + b\n" * 60_000  # ~2 MB

    async def scenario(client, async_engine):
        big = asyncio.create_task(client.post("/v1/completions",
                                              json={**REQUEST, "prompt": huge}))
        latencies = []
        while not big.done():
            started = asyncio.get_running_loop().time()
            assert (await client.get("/health")).status_code == 200
            latencies.append(asyncio.get_running_loop().time() - started)
            await asyncio.sleep(0.01)
        return await big, latencies

    response, latencies = run_with_app(engine, scenario)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert len(latencies) >= 5, "the huge prompt was tokenized too fast to observe"
    assert max(latencies) < 0.25, latencies


def test_a_request_that_fails_alone_is_a_500_and_its_neighbours_are_served(engine,
                                                                           monkeypatch):
    from tokenmill.runner.sampling import StepSampler

    good = {**REQUEST, "max_tokens": 8, "seed": 3, "temperature": 1.0}

    async def alone(client, async_engine):
        return (await client.post("/v1/completions", json=good)).json()

    expected = run_with_app(engine, alone)["choices"][0]["text"]
    real = StepSampler.run

    def run(self, requests, *args, **kwargs):
        if any(r.sampling is not None and r.sampling.params.seed == 666 for r in requests):
            raise RuntimeError("injected failure for seed 666")
        return real(self, requests, *args, **kwargs)

    monkeypatch.setattr(StepSampler, "run", run)

    async def together(client, async_engine):
        bad = client.post("/v1/completions", json={**good, "seed": 666})
        return await asyncio.gather(bad, client.post("/v1/completions", json=good))

    bad, served = run_with_app(engine, together)
    assert bad.status_code == 500 and "seed 666" in bad.json()["error"]["message"]
    assert served.status_code == 200
    assert served.json()["choices"][0]["text"] == expected
    assert engine.kv_manager.usage == 0.0
    engine.check_integrity()
