"""A server started with speculative decoding serves the same greedy text and counts
its drafts in /metrics."""

from __future__ import annotations

import httpx

from tests.server.conftest import MODEL_NAME, metric_value

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]


def complete(server) -> list[str]:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    response = httpx.post(server.url + "/v1/completions", json=body,
                          headers=server.auth_headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_ngram_server_matches_plain_and_reports_acceptance(server, server_factory):
    spec = server_factory("--speculative-method", "ngram", "--prompt-lookup-min", "1",
                          "--no-spec-adaptive")
    assert complete(spec) == complete(server)
    text = httpx.get(spec.url + "/metrics", timeout=5).text
    drafted = metric_value(text, "tokenmill:spec_decode_num_draft_tokens_total")
    accepted = metric_value(text, "tokenmill:spec_decode_num_accepted_tokens_total")
    assert drafted and drafted > 0
    assert 0 <= accepted <= drafted
    first = metric_value(text, "tokenmill:spec_decode_num_accepted_tokens_per_pos_total",
                         position="0")
    assert first is not None and first <= accepted
