"""A soak: thousands of mixed requests through one server, and its memory stays flat.

Slow (about a minute): `pytest -m slow tests/server/test_soak.py`. Resident memory is
read after a warm-up (every path's caches and kernels built) and at the end; anything
kept per request (caches keyed by shape, metric label sets, per-request state left
behind) would show as growth proportional to the number of requests.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

WARM_UP, MEASURED, CONCURRENCY = 400, 2000, 8
# Allowed growth after the warm-up, for all MEASURED requests together.
GROWTH_BOUND_MB = 24


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def request_body(rng: random.Random) -> tuple[str, dict]:
    words = " ".join(rng.choice(["def", "x", "return", "class", "(", "):", "for", "in"])
                     for _ in range(rng.randint(1, 60)))
    common = {"model": MODEL_NAME, "max_tokens": rng.randint(1, 24),
              "temperature": rng.choice([0, 0.8]), "seed": rng.choice([None, rng.randint(0, 99)])}
    kind = rng.random()
    if kind < 0.3:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words}],
                                        "stream": rng.random() < 0.5}
    if kind < 0.4:
        return "/v1/completions", {**common, "prompt": words, "n": 2, "logprobs": 2}
    return "/v1/completions", {**common, "prompt": words, "stream": rng.random() < 0.5,
                               "stop": rng.choice([None, ["\n"]])}


async def hammer(server, count: int, seed: int) -> None:
    rng = random.Random(seed)
    bodies = [request_body(rng) for _ in range(count)]
    queue: asyncio.Queue = asyncio.Queue()
    for item in bodies:
        queue.put_nowait(item)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            path, body = queue.get_nowait()
            response = await client.post(path, json=body, headers=server.auth_headers)
            assert response.status_code == 200, response.text

    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))


@pytest.mark.slow
def test_resident_memory_stays_flat_over_thousands_of_requests(server_factory):
    server = server_factory("--max-num-seqs", "16")
    asyncio.run(hammer(server, WARM_UP, seed=0))
    before = rss_mb(server.process.pid)
    asyncio.run(hammer(server, MEASURED, seed=1))
    after = rss_mb(server.process.pid)
    print(f"RSS after {WARM_UP} warm-up requests {before:.0f} MB, after {MEASURED} more "
          f"{after:.0f} MB")
    assert after - before < GROWTH_BOUND_MB, (before, after)
