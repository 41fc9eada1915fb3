"""`tokenmill bench serve`: a load generator for OpenAI-compatible /v1/completions.

Works against any server that streams server-sent events in the OpenAI format
(tokenmill's, llama.cpp's llama-server, vLLM's). Two arrival modes:
- closed loop: --concurrency C keeps C requests in flight;
- open loop: --request-rate R sends requests at Poisson (burstiness 1) or gamma
  (burstiness k: shape k, same mean rate) arrival times, optionally capped by
  --concurrency.
The first --warmup requests run before the timed part and are not counted. The run
stops issuing requests after --num-requests or --duration seconds, whichever comes
first; every issued request ends as completed or failed (with its error).

The client is aiohttp (as vLLM's serving benchmark): the client shares the server's
machine here, and httpx's streaming cost ~0.18 ms of CPU per event, which the server
then lacked; aiohttp's ~0.06 (docs/BENCHMARKS.md, server overhead).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
from tqdm.auto import tqdm

from tokenmill.bench.metrics import (
    NO_SLO,
    SLO,
    RequestRecord,
    RunSummary,
    format_summary,
    summarize,
)
from tokenmill.bench.workload import WorkloadRequest


@dataclass(frozen=True)
class LoadConfig:
    base_url: str
    model: str | None = None
    api_key: str | None = None
    concurrency: int | None = None
    request_rate: float | None = None  # requests/s; None: closed loop
    burstiness: float = 1.0  # gamma shape; 1 = Poisson
    num_warmup: int = 0
    duration_s: float | None = None
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.concurrency is None and self.request_rate is None:
            raise ValueError("give concurrency, request_rate, or both")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency!r}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate!r}")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness!r}")


@dataclass
class LoadResult:
    records: list[RequestRecord]
    duration_s: float
    num_not_sent: int  # stopped by the duration bound before being issued
    summary: RunSummary

    def to_json(self, config: LoadConfig) -> dict:
        settings = asdict(config)
        settings.pop("api_key")
        return {"config": settings, "summary": self.summary.to_json(),
                "num_not_sent": self.num_not_sent,
                "requests": [r.to_json() for r in self.records]}


def arrival_gaps(rate: float, burstiness: float, count: int, seed: int) -> list[float]:
    """Seconds between consecutive sends: gamma(shape k, scale 1/(k*rate)), mean 1/rate."""
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (burstiness * rate)) for _ in range(count)]


def _payload(config: LoadConfig, request: WorkloadRequest) -> dict:
    body = {"prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if config.model is not None:
        body["model"] = config.model
    return body


async def send_request(client: aiohttp.ClientSession, config: LoadConfig,
                       request: WorkloadRequest, request_id: str) -> RequestRecord:
    """Stream one completion, stamping each chunk that carries text."""
    record = RequestRecord(request_id, request.prompt_len, time.perf_counter())
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    try:
        async with client.post(config.base_url.rstrip("/") + "/v1/completions",
                               json=_payload(config, request), headers=headers) as response:
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status}: {body[:300]}")
            pending = b""  # a line not yet ended (events are lines; reads cut anywhere)
            async for data in response.content.iter_any():
                now = time.perf_counter()
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    _consume_event(line.decode(), record, now)
            _consume_event(pending.decode(), record, time.perf_counter())
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, none is raised
        record.success = False
        record.error = f"{type(exc).__name__}: {exc}"
    record.end_time = time.perf_counter()
    if record.success and not record.chunk_times:
        record.success = False
        record.error = record.error or "the stream carried no output"
    return record


def _consume_event(line: str, record: RequestRecord, now: float) -> None:
    if not line.startswith("data:"):
        return
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return
    event = json.loads(data)
    if "error" in event:
        raise RuntimeError(f"stream error: {event['error']}")
    usage = event.get("usage")
    if usage:
        record.reported_output_tokens = usage.get("completion_tokens")
    for choice in event.get("choices") or []:
        # One chunk may carry several tokens when the server coalesces; the usage total
        # corrects the count, and ITL stays one gap per chunk. A chunk before the
        # finishing one counts even without text: llama-server and vLLM send a token that
        # decodes to no text yet as an empty chunk (most of a random model's tokens, whose
        # ids lie past its small tokenizer's; counting only text put those peers' first
        # token at their last). The finishing chunk counts if it carries text, or if
        # nothing came before it.
        finished = choice.get("finish_reason")
        if choice.get("text") or not finished or not record.chunk_times:
            record.chunk_times.append(now)
            record.chunk_tokens.append(1)


async def run_load(config: LoadConfig, workload: Sequence[WorkloadRequest],
                   slo: SLO = NO_SLO, progress: bool = True) -> LoadResult:
    # timeout_s bounds each wait for the server (a stream may run longer in all).
    timeout = aiohttp.ClientTimeout(total=None, connect=30.0, sock_read=config.timeout_s)
    # No cap (--concurrency is the cap), and a connection of its own for every request:
    # reusing a kept-alive one raced llama-server closing it, and 6 of 32 requests at 8
    # streams failed before the server saw them ("Can not write request body", "Server
    # disconnected"), which counted in its throughput as requests never sent.
    connections = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connections) as client:
        warm = list(workload[:config.num_warmup])
        timed = list(workload[config.num_warmup:])
        if warm:
            await asyncio.gather(*(send_request(client, config, r, f"warmup-{i}")
                                   for i, r in enumerate(warm)))
        return await _timed_run(client, config, timed, slo, progress)


async def _timed_run(client: aiohttp.ClientSession, config: LoadConfig,
                     workload: Sequence[WorkloadRequest], slo: SLO, progress: bool
                     ) -> LoadResult:
    slots = asyncio.Semaphore(config.concurrency) if config.concurrency else None
    gaps = (arrival_gaps(config.request_rate, config.burstiness, len(workload), config.seed)
            if config.request_rate else [0.0] * len(workload))
    bar = tqdm(total=len(workload), desc="requests", disable=not progress, leave=False)
    start = time.perf_counter()
    deadline = start + config.duration_s if config.duration_s else None

    async def one(index: int, request: WorkloadRequest) -> RequestRecord:
        try:
            return await send_request(client, config, request, f"req-{index}")
        finally:
            if slots is not None:
                slots.release()
            bar.update(1)

    tasks: list[asyncio.Task] = []
    next_send = start
    for index, request in enumerate(workload):
        next_send += gaps[index]
        delay = next_send - time.perf_counter()
        if deadline is not None and max(next_send, time.perf_counter()) >= deadline:
            break
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is not None:
            if deadline is None:
                await slots.acquire()
            else:
                try:
                    await asyncio.wait_for(slots.acquire(), deadline - time.perf_counter())
                except TimeoutError:
                    break
        tasks.append(asyncio.create_task(one(index, request)))
    records = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    bar.close()
    return LoadResult(records, duration, len(workload) - len(records),
                      summarize(records, duration, slo))


# ---- command line ------------------------------------------------------------------------
def add_serve_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.bench.workload import add_workload_arguments

    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name sent in each request")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory for text workloads (default: --model)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="synthetic token ids are drawn below this (default: tokenizer's)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=None)
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of inter-arrival times (1 = Poisson)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--duration", type=float, default=None, help="stop issuing after s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=None, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=None, help="seconds")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    add_workload_arguments(parser)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from tokenmill.bench.workload import build_workload, workload_spec_from_args

    try:
        config = LoadConfig(args.base_url, args.model, args.api_key, args.concurrency,
                            args.request_rate, args.burstiness, args.warmup, args.duration,
                            args.seed)
        spec = workload_spec_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokenizer = None
    if args.tokenizer or args.model:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
        except (OSError, ValueError):
            tokenizer = None
    vocab = args.vocab_size or (len(tokenizer) if tokenizer is not None else None)
    if vocab is None:
        print("error: give --tokenizer (or a --model directory) or --vocab-size",
              file=sys.stderr)
        return 2
    special = frozenset(tokenizer.all_special_ids) if tokenizer is not None else frozenset()
    # The warm-up requests come first, on top of the counted ones.
    spec = dataclasses.replace(spec, num_requests=spec.num_requests + args.warmup)
    workload = build_workload(spec, vocab, tokenizer, special)
    result = asyncio.run(run_load(config, workload, SLO(args.slo_ttft, args.slo_tpot)))
    print(format_summary(result.summary, f"{args.base_url}"))
    if result.num_not_sent:
        print(f"{result.num_not_sent} requests not sent (duration bound)")
    failures = [r.error for r in result.records if not r.success]
    if failures:
        print(f"first failure: {failures[0]}", file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result.to_json(config), indent=2))
        print(f"wrote {args.out}")
    return 0
