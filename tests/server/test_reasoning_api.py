"""The chat endpoint of a reasoning model (in-process app): reasoning_content apart from
content, whole and streamed alike, thinking_budget in the body and as the server's
default, errors naming the field, and thinking tokens in usage and /metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.engine import LLMEngine
from tokenmill.server.app import build_app

MODEL = "tiny-thinker"
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 20, "temperature": 0,
            **fields}


@pytest.fixture(scope="module")
def engine(thinking_model_dir) -> LLMEngine:
    return LLMEngine.from_kwargs(str(thinking_model_dir), progress=False)


@pytest.fixture(scope="module")
def offline(thinking_model_dir) -> LLM:
    return LLM(str(thinking_model_dir), progress=False)


def run_with_app(engine: LLMEngine, scenario, **app_options) -> object:
    async def main():
        async_engine = AsyncLLMEngine(engine)
        async_engine.start()
        transport = httpx.ASGITransport(app=build_app(async_engine, MODEL, **app_options))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://app",
                                         timeout=60) as client:
                return await scenario(client)
        finally:
            await async_engine.shutdown(1.0)

    return asyncio.run(main())


def stream_events(body: str) -> list[dict]:
    lines = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("budget", [0, 5, 11])
def test_chat_splits_reasoning_from_content_whole_and_streamed(engine, offline, budget):
    expected = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=20,
                                                     thinking_budget=budget))[0].outputs[0]

    async def scenario(client):
        whole = await client.post("/v1/chat/completions", json=chat(thinking_budget=budget))
        streamed = await client.post("/v1/chat/completions", json=chat(
            thinking_budget=budget, stream=True, stream_options={"include_usage": True}))
        return whole, streamed

    whole, streamed = run_with_app(engine, scenario)
    assert whole.status_code == 200, whole.text
    body = whole.json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == expected.reasoning_content
    assert message["content"] == expected.content
    assert "</think>" not in message["content"] and "<think>" not in message["content"]
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == budget
    events = stream_events(streamed.text)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert events[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == budget


def test_server_default_budget_and_metrics(engine):
    async def scenario(client):
        response = await client.post("/v1/chat/completions", json=chat())
        explicit = await client.post("/v1/chat/completions", json=chat(thinking_budget=2))
        return response, explicit, (await client.get("/metrics")).text

    response, explicit, metrics = run_with_app(engine, scenario, default_thinking_budget=4)
    assert response.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4
    assert explicit.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2
    assert 'tokenmill:reasoning_tokens_total{model_name="tiny-thinker"} 6.0' in metrics
    assert 'tokenmill:request_thinking_tokens_count{model_name="tiny-thinker"} 2.0' in metrics


@pytest.mark.parametrize(("fields", "param"), [
    ({"thinking_budget": -1}, "thinking_budget"),
    ({"thinking_budget": "many"}, "thinking_budget"),
    ({"thinking_budget": 3, "min_thinking": 4}, "min_thinking"),
    ({"min_thinking": -2}, "min_thinking"),
    ({"thinking_bridge": 7}, "thinking_bridge"),
])
def test_bad_thinking_fields_are_a_400_naming_the_field(engine, fields, param):
    async def scenario(client):
        return [await client.post(path, json=body) for path, body in (
            ("/v1/chat/completions", chat(**fields)),
            ("/v1/completions", {"model": MODEL, "prompt": "x", **fields}))]

    for response in run_with_app(engine, scenario):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_thinking_budget_on_a_model_that_does_not_reason_is_a_400(llama_dir):
    plain = LLMEngine.from_kwargs(str(llama_dir), progress=False)

    async def scenario(client):
        return await client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                          "thinking_budget": 8})

    response = run_with_app(plain, scenario)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "thinking_budget"
    with pytest.raises(ValueError, match="does not reason"):
        build_app(AsyncLLMEngine(plain), MODEL, default_thinking_budget=8)
