"""Clients that leave, more clients than the queue admits, and SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx

from tests.server.conftest import MODEL_NAME, metric_value, wait_for_metric

KV_USAGE = "tokenmill:kv_cache_usage_perc"
RUNNING = "tokenmill:num_requests_running"
ABORTED = "tokenmill:num_aborted_requests_total"
LONG = {"model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": 480, "ignore_eos": True,
        "temperature": 0}


def metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=5).text


def test_dropped_stream_is_aborted_and_frees_its_kv_blocks(server):
    aborted_before = metric_value(metrics(server), ABORTED)
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/v1/completions",
                           json={**LONG, "stream": True}, headers=server.auth_headers) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert metric_value(metrics(server), KV_USAGE) > 0
    # Leaving the `with` closed the connection mid-stream.
    assert wait_for_metric(server, KV_USAGE, lambda v: v == 0.0) == 0.0
    assert wait_for_metric(server, RUNNING, lambda v: v == 0) == 0
    assert metric_value(metrics(server), ABORTED) >= aborted_before + 1
    assert httpx.get(server.url + "/health").status_code == 200


def test_client_gone_during_non_streamed_request_aborts_it(server):
    aborted_before = metric_value(metrics(server), ABORTED)
    # Sixteen prompts in one request: long enough (on a fast host one tiny-model
    # request of 480 tokens can finish before the disconnect is noticed).
    body = json.dumps({**LONG, "prompt": [LONG["prompt"]] * 16}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(head + body)
        # Leave only once the request is being generated.
        assert wait_for_metric(server, RUNNING, lambda v: v >= 1) >= 1
    assert wait_for_metric(server, ABORTED, lambda v: v >= aborted_before + 1) >= \
        aborted_before + 1
    assert wait_for_metric(server, KV_USAGE, lambda v: v == 0.0) == 0.0


def test_overload_rejects_with_retry_after_and_loses_nothing(server_factory):
    server = server_factory("--max-num-seqs", "2", "--max-queue", "2")
    num_requests = 12
    payload = {**LONG, "max_tokens": 240}

    async def one(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/completions", json=payload, headers=server.auth_headers)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(one(client) for _ in range(num_requests)))

    responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    rejected = [r for r in responses if r.status_code == 429]
    admitted = [r for r in responses if r.status_code == 200]
    assert rejected and len(admitted) >= 4, codes
    for r in rejected:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
    for r in admitted:
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 240
    assert wait_for_metric(server, KV_USAGE, lambda v: v == 0.0) == 0.0
    # Capacity frees up again once the burst is over.
    after = httpx.post(server.url + "/v1/completions", json=payload,
                       headers=server.auth_headers, timeout=60)
    assert after.status_code == 200


def _stream_in_thread(server, payload: dict, sink: list, first_chunk: threading.Event) -> None:
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=payload,
                          headers=server.auth_headers, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    sink.append(line[5:].strip())
                    first_chunk.set()
    except httpx.HTTPError as exc:
        sink.append(exc)
    finally:
        first_chunk.set()


def test_sigterm_drains_with_503s_and_lets_in_flight_requests_finish(server_factory):
    server = server_factory("--shutdown-grace", "20")
    sink: list = []
    first_chunk = threading.Event()
    payload = {**LONG, "stream": True}
    thread = threading.Thread(target=_stream_in_thread,
                              args=(server, payload, sink, first_chunk))
    thread.start()
    assert first_chunk.wait(30)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    # While draining the server still answers: 503 with Retry-After, not a refused
    # connection (unless the drain is already over: the stream was short).
    late = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 4},
                      headers=server.auth_headers, timeout=10)
    health = httpx.get(server.url + "/health", timeout=10)
    returncode = server.process.wait(timeout=30)
    elapsed = time.monotonic() - started
    thread.join(30)
    assert returncode == 0, server.log()
    assert late.status_code == 503 and int(late.headers["Retry-After"]) >= 1
    assert late.json()["error"]["type"] == "service_unavailable_error"
    assert health.status_code == 503
    # The in-flight stream finished normally, then the server left at once.
    assert sink[-1] == "[DONE]"
    finals = [json.loads(s)["choices"][0]["finish_reason"] for s in sink[:-1]
              if json.loads(s)["choices"]]
    assert finals[-1] == "length"
    assert elapsed < 10


def test_past_the_grace_period_requests_end_with_an_error_they_see(server_factory):
    # A short grace: on a fast host the 16 completions' last ~480 steps took under 0.5 s,
    # so with a 0.5 s grace they sometimes finished inside it and the test saw no error.
    grace = 0.1
    server = server_factory("--shutdown-grace", str(grace), "--num-threads", "1")
    sink: list = []
    first_chunk = threading.Event()
    payload = {**LONG, "n": 8, "stream": True}  # 8 x 480 tokens: longer than the grace
    thread = threading.Thread(target=_stream_in_thread,
                              args=(server, payload, sink, first_chunk))
    thread.start()
    assert first_chunk.wait(30)
    unstreamed: list = []

    def post() -> None:
        unstreamed.append(httpx.post(server.url + "/v1/completions", json={**LONG, "n": 8},
                                     headers=server.auth_headers, timeout=30))

    poster = threading.Thread(target=post)
    poster.start()
    assert wait_for_metric(server, RUNNING, lambda v: v >= 16) >= 16
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    returncode = server.process.wait(timeout=30)
    elapsed = time.monotonic() - started
    thread.join(30)
    poster.join(30)
    assert returncode == 0, server.log()
    assert elapsed < grace + 1.5  # the grace, and about a second to close
    assert sink[-1] == "[DONE]"
    error = json.loads(sink[-2])["error"]
    assert error["code"] == "unavailable" and "shut down" in error["message"]
    assert unstreamed[0].status_code == 503
    assert "shut down" in unstreamed[0].json()["error"]["message"]
