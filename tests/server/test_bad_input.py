"""Bad requests get a 4xx in OpenAI's error shape, and the server stays healthy."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}


def body(**fields) -> bytes:
    return json.dumps({"model": MODEL_NAME, **fields}).encode()


def chat(**fields) -> bytes:
    return body(messages=[{"role": "user", "content": "hi"}], **fields)


# (id, path, raw body, expected status, expected param or None)
CASES = [
    ("wrong-type-max-tokens", CMPL, body(prompt="x", max_tokens="many"), 400, "max_tokens"),
    ("wrong-type-prompt", CMPL, body(prompt={"a": 1}), 400, None),
    ("missing-prompt", CMPL, body(max_tokens=3), 400, "prompt"),
    ("negative-temperature", CMPL, body(prompt="x", temperature=-0.5), 400, "temperature"),
    ("top-p-zero", CMPL, body(prompt="x", top_p=0), 400, "top_p"),
    ("n-zero", CMPL, body(prompt="x", n=0), 400, "n"),
    ("huge-n", CMPL, body(prompt="x", n=100000), 400, "n"),
    ("max-tokens-negative", CMPL, body(prompt="x", max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-zero-without-echo", CMPL, body(prompt="x", max_tokens=0), 400, "max_tokens"),
    ("logprobs-too-many", CMPL, body(prompt="x", logprobs=99), 400, "logprobs"),
    ("prompt-logprobs-too-many", CMPL, body(prompt="x", prompt_logprobs=99), 400,
     "prompt_logprobs"),
    ("prompt-logprobs-negative", CMPL, body(prompt="x", prompt_logprobs=-1), 400,
     "prompt_logprobs"),
    ("negative-seed", CMPL, body(prompt="x", seed=-3), 400, "seed"),
    ("penalty-out-of-range", CMPL, body(prompt="x", presence_penalty=5), 400,
     "presence_penalty"),
    ("empty-stop-string", CMPL, body(prompt="x", stop=[""]), 400, "stop"),
    ("empty-prompt", CMPL, body(prompt=""), 400, "prompt"),
    ("empty-prompt-list", CMPL, body(prompt=[]), 400, "prompt"),
    ("token-id-out-of-vocab", CMPL, body(prompt=[1, 10**6]), 400, "prompt"),
    ("prompt-plus-max-tokens-over-context", CMPL, body(prompt="x", max_tokens=512), 400,
     "max_tokens"),
    ("prompt-over-context", CMPL, body(prompt=list(range(1, 300)) * 2), 400, "prompt"),
    ("unknown-model", CMPL, json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404,
     "model"),
    ("malformed-json", CMPL, b'{"prompt": "x",', 400, None),
    ("invalid-utf8", CMPL, b'{"prompt": "\xff\xfe"}', 400, None),
    ("json-not-an-object", CMPL, b"[1, 2]", 400, None),
    ("empty-messages", CHAT, body(messages=[]), 400, "messages"),
    ("messages-wrong-type", CHAT, body(messages="hello"), 400, "messages"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat-unknown-model", CHAT, json.dumps({"model": "x", "messages": [
        {"role": "user", "content": "hi"}]}).encode(), 404, "model"),
    ("chat-over-context", CHAT, chat(max_tokens=10**6), 400, "max_tokens"),
    ("detokenize-bad-token", "/detokenize", json.dumps({"tokens": [-1]}).encode(), 400,
     "tokens"),
    ("tokenize-nothing", "/tokenize", b"{}", 400, "prompt"),
    # The hardening issue's list: each was a 500, an accepted absurd value or a wrong param.
    ("lone-surrogate", CMPL, body(prompt="abc \ud800"), 400, "prompt"),
    ("lone-surrogate-in-list", CMPL, body(prompt=["ok", "abc \udfff"]), 400, "prompt"),
    ("lone-surrogate-in-chat", CHAT, body(messages=[{"role": "user", "content": "\ud800"}]),
     400, "messages"),
    ("lone-surrogate-tokenize", "/tokenize", json.dumps({"prompt": "\ud800"}).encode(), 400,
     "prompt"),
    ("top-k-past-int64", CMPL, body(prompt="x", top_k=2**63), 400, "top_k"),
    ("stop-token-id-huge", CMPL, body(prompt="x", stop_token_ids=[2**70]), 400,
     "stop_token_ids"),
    ("stop-token-id-out-of-vocab", CMPL, body(prompt="x", stop_token_ids=[10**6]), 400,
     "stop_token_ids"),
    ("min-tokens-huge", CMPL, body(prompt="x", max_tokens=None, min_tokens=2**70), 400,
     "min_tokens"),
    ("logit-bias-not-a-token", CMPL, body(prompt="x", logit_bias={"abc": 1}), 400,
     "logit_bias"),
    ("logit-bias-out-of-vocab", CMPL, body(prompt="x", logit_bias={"1000000": 1}), 400,
     "logit_bias"),
    ("logit-bias-out-of-range", CMPL, body(prompt="x", logit_bias={"5": 1000}), 400,
     "logit_bias"),
    ("best-of-below-n", CMPL, body(prompt="x", n=2, best_of=1), 400, "best_of"),
    ("best-of-above-n", CMPL, body(prompt="x", n=1, best_of=3), 400, "best_of"),
    ("top-logprobs-too-many", CHAT, chat(logprobs=True, top_logprobs=99), 400, "top_logprobs"),
    ("max-completion-tokens-negative", CHAT, chat(max_completion_tokens=-2), 400,
     "max_completion_tokens"),
    ("prompt-of-the-wrong-type", CMPL, body(prompt=[1.5, 2]), 400, "prompt"),
]


def assert_error_shape(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("path,raw,status,param", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_request_is_a_4xx_in_openai_shape(server, path, raw, status, param):
    response = httpx.post(server.url + path, content=raw, headers={**JSON, **server.auth_headers},
                          timeout=30)
    assert_error_shape(response, status, param)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_oversized_body_is_413(server):
    raw = body(prompt="x" * 100_000)
    response = httpx.post(server.url + CMPL, content=raw, headers={**JSON, **server.auth_headers},
                          timeout=30)
    assert_error_shape(response, 413)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_oversized_chunked_body_is_413(server):
    def chunks():
        for _ in range(20):
            yield b"x" * 8192

    response = httpx.post(server.url + CMPL, content=chunks(),
                          headers={**JSON, **server.auth_headers}, timeout=30)
    assert_error_shape(response, 413)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": "Basic test-key"}],
                         ids=["missing", "wrong", "wrong-scheme"])
def test_bad_api_key_is_401(server, headers):
    for path in (CMPL, CHAT, "/tokenize"):
        response = httpx.post(server.url + path, content=chat(prompt="x"),
                              headers={**JSON, **headers}, timeout=30)
        assert_error_shape(response, 401)
    assert_error_shape(httpx.get(server.url + "/v1/models", headers=headers), 401)
    # Health and metrics stay open for probes and scrapers.
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_unknown_route_is_404_in_openai_shape(server):
    assert_error_shape(httpx.get(server.url + "/v1/nothing", headers=server.auth_headers), 404)


def test_model_without_chat_template_is_400(tmp_path, llama_dir):
    """In-process: a tokenizer without a chat template makes chat requests 400."""
    import asyncio

    from tokenmill.engine.async_engine import AsyncLLMEngine
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.server.app import build_app

    engine = LLMEngine.from_kwargs(str(llama_dir), progress=False)
    engine.tokenizer.chat_template = None
    async_engine = AsyncLLMEngine(engine)

    async def run() -> httpx.Response:
        async_engine.start()
        app = build_app(async_engine, MODEL_NAME)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            response = await client.post(CHAT, content=chat(), headers=JSON)
        await async_engine.shutdown(1.0)
        return response

    response = asyncio.run(run())
    assert_error_shape(response, 400, "messages")
    assert "chat template" in response.json()["error"]["message"]


def test_valid_json_sent_as_text_plain_gets_a_message_that_says_so(server):
    response = httpx.post(server.url + CMPL, content=body(prompt="x"),
                          headers={"Content-Type": "text/plain", **server.auth_headers},
                          timeout=30)
    assert_error_shape(response, 400)
    assert "application/json" in response.json()["error"]["message"]


def complete(server, **fields) -> httpx.Response:
    return httpx.post(server.url + CMPL, headers={**JSON, **server.auth_headers}, timeout=30,
                      content=body(prompt="def add(a, b):", max_tokens=6, **fields))


def test_logit_bias_forces_a_token(server):
    response = complete(server, temperature=0, logit_bias={"7": 100})
    assert response.status_code == 200, response.text
    forced = httpx.post(server.url + "/detokenize", json={"tokens": [7] * 6},
                        headers=server.auth_headers, timeout=30).json()["prompt"]
    assert response.json()["choices"][0]["text"] == forced


def test_a_tiny_temperature_is_greedy_not_garbage(server):
    greedy = complete(server, temperature=0).json()["choices"][0]["text"]
    assert complete(server, temperature=1e-40).json()["choices"][0]["text"] == greedy


def test_one_request_with_more_completions_than_capacity_is_refused(server_factory):
    server = server_factory("--max-num-seqs", "4", "--max-queue", "4")
    response = httpx.post(server.url + CMPL, content=body(prompt="x", n=20, max_tokens=2),
                          headers={**JSON, **server.auth_headers}, timeout=30)
    assert_error_shape(response, 400, "n")
    assert "8" in response.json()["error"]["message"]
