"""The load generator against a real `tokenmill serve` process on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import statistics

import pytest

from tests.server.conftest import API_KEY, MODEL_NAME, start_server
from tokenmill.bench.metrics import SLO, RequestRecord
from tokenmill.bench.serve_load import LoadConfig, _consume_event, arrival_gaps, run_load
from tokenmill.bench.workload import WorkloadSpec, build_workload


@pytest.fixture(scope="module")
def bench_server(llama_dir, tmp_path_factory):
    proc = start_server(llama_dir, tmp_path_factory.mktemp("bench-server"))
    yield proc
    proc.stop()


def workload(n: int, seed: int = 0):
    return build_workload(WorkloadSpec(num_requests=n, input_len=12, output_len=6,
                                       length_dist="uniform", seed=seed), 384,
                          avoid_token_ids=frozenset({0}))


def test_closed_loop_accounts_for_every_request(bench_server, tmp_path):
    config = LoadConfig(bench_server.url, MODEL_NAME, API_KEY, concurrency=3, num_warmup=2)
    requests = workload(12)
    result = asyncio.run(run_load(config, requests, SLO(ttft_s=30.0, tpot_s=30.0),
                                  progress=False))
    assert len(result.records) == 10 and result.num_not_sent == 0
    failures = [r.error for r in result.records if not r.success]
    assert not failures, failures
    summary = result.summary
    assert summary.completed == 10 and summary.failed == 0
    # ignore_eos: every request produced exactly its max_tokens, counted via usage
    assert [r.output_tokens for r in result.records] == [r.max_tokens for r in requests[2:]]
    assert summary.output_tokens == sum(r.max_tokens for r in requests[2:])
    assert summary.goodput_share == 1.0
    assert all(r.ttft > 0 and r.e2e >= r.ttft for r in result.records)
    path = tmp_path / "load.json"
    path.write_text(json.dumps(result.to_json(config)))
    saved = json.loads(path.read_text())
    assert len(saved["requests"]) == 10 and "api_key" not in saved["config"]
    assert saved["summary"]["completed"] == 10


def test_poisson_arrivals_bounded_by_time_account_for_every_request(bench_server):
    config = LoadConfig(bench_server.url, MODEL_NAME, API_KEY, request_rate=8.0,
                        duration_s=1.5, seed=1)
    requests = workload(200, seed=1)
    result = asyncio.run(run_load(config, requests, progress=False))
    sent = len(result.records)
    assert 0 < sent < 200 and sent + result.num_not_sent == 200
    assert result.summary.completed + result.summary.failed == sent
    assert result.summary.failed == 0, [r.error for r in result.records if r.error]


def test_wrong_key_is_recorded_as_failure_not_raised(bench_server):
    config = LoadConfig(bench_server.url, MODEL_NAME, "wrong", concurrency=2)
    result = asyncio.run(run_load(config, workload(2), progress=False))
    assert result.summary.failed == 2
    assert all("401" in r.error for r in result.records)


def test_gamma_gaps_have_the_requested_mean_rate():
    gaps = arrival_gaps(rate=4.0, burstiness=0.5, count=4000, seed=0)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)
    assert arrival_gaps(4.0, 0.5, 10, 3) == arrival_gaps(4.0, 0.5, 10, 3)


def test_empty_token_chunks_time_the_stream_the_finishing_chunk_does_not():
    # llama-server's stream for 3 tokens that decode to no text: one empty chunk per
    # token, then an empty finishing chunk; the first token arrived at t=1, not at t=9.
    record = RequestRecord("r", 4, start_time=0.0)
    token = {"choices": [{"text": "", "index": 0, "finish_reason": None}]}
    finish = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
              "usage": {"completion_tokens": 3}}
    for now, event in ((1.0, token), (2.0, token), (3.0, token), (9.0, finish)):
        _consume_event("data: " + json.dumps(event), record, now)
    _consume_event("data: [DONE]", record, 9.0)
    assert record.chunk_times == [1.0, 2.0, 3.0]
    assert record.ttft == 1.0 and record.tpot == 1.0 and record.output_tokens == 3
    # A stream whose only chunk is the finishing one (text or not) still shows output.
    alone = RequestRecord("s", 4, start_time=0.0)
    _consume_event("data: " + json.dumps(finish), alone, 5.0)
    assert alone.chunk_times == [5.0]
    # Text in the finishing chunk counts as a chunk of its own.
    last = RequestRecord("t", 4, start_time=0.0)
    _consume_event("data: " + json.dumps(token), last, 1.0)
    _consume_event("data: " + json.dumps({"choices": [{"text": "x", "finish_reason": "stop"}]}),
                   last, 2.0)
    assert last.chunk_times == [1.0, 2.0]


async def _one_request_per_connection(reader: asyncio.StreamReader,
                                      writer: asyncio.StreamWriter) -> None:
    """A server that streams one completion on a connection, keeps it open without
    saying so, and drops it when a second request arrives on it (llama-server's
    kept-alive connections did that to the load generator)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    events = [{"choices": [{"text": "a", "index": 0, "finish_reason": None}]},
              {"choices": [{"text": "b", "index": 0, "finish_reason": "length"}],
               "usage": {"completion_tokens": 2}}]
    body = [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    for part in body:
        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    try:  # the next request on this connection (or the client's close), then drop it
        await asyncio.wait_for(reader.read(1), 5.0)
    except TimeoutError:
        pass
    writer.close()


def test_every_request_gets_a_connection_of_its_own():
    async def run():
        server = await asyncio.start_server(_one_request_per_connection, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            config = LoadConfig(f"http://127.0.0.1:{port}", concurrency=1)
            return await run_load(config, workload(6), progress=False)

    result = asyncio.run(run())
    assert [r.error for r in result.records if not r.success] == []
    assert [r.output_tokens for r in result.records] == [2] * 6


def test_the_report_names_failed_requests_and_their_errors():
    from tokenmill.bench.metrics import summarize
    from tokenmill.bench.report import SystemResult, markdown_table

    def record(i: int, error: str | None) -> RequestRecord:
        if error:
            return RequestRecord(f"r{i}", 16, 0.0, end_time=0.1, success=False, error=error)
        return RequestRecord(f"r{i}", 16, 0.0, chunk_times=[1.0, 2.0], chunk_tokens=[1, 1],
                             end_time=2.0)

    clean = [record(i, None) for i in range(4)]
    broken = [record(0, None), record(1, None), record(2, "ServerDisconnectedError: x"),
              record(3, "ServerDisconnectedError: x")]
    results = [SystemResult("clean", 2, [summarize(clean, 2.0)], clean),
               SystemResult("broken", 2, [summarize(broken, 2.0)], broken)]
    table = markdown_table(results, "clean")
    assert "- **broken: 2 of 4 requests failed** (2 x ServerDisconnectedError: x)" in table
    assert "**clean" not in table
    assert results[1].to_json()["errors"] == {"ServerDisconnectedError: x": 2}
