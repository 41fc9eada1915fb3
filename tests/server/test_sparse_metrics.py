"""A server on a sparse attention backend answers and counts what sparse attention
attended in /metrics (keys and queries, so keys per query is their ratio)."""

from __future__ import annotations

import httpx

from tests.server.conftest import MODEL_NAME, metric_value


def test_quest_server_reports_keys_per_query(server_factory):
    sparse = server_factory("--attention-backend", "quest", "--sparse-budget", "16",
                            "--sparse-dense-layers", "0", "--block-size", "4")
    body = {"model": MODEL_NAME, "prompt": list(range(5, 45)), "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}
    response = httpx.post(sparse.url + "/v1/completions", json=body,
                          headers=sparse.auth_headers, timeout=60)
    assert response.status_code == 200, response.text
    text = httpx.get(sparse.url + "/metrics", timeout=5).text
    keys = metric_value(text, "tokenmill:sparse_attention_keys_total")
    queries = metric_value(text, "tokenmill:sparse_attention_queries_total")
    assert queries and queries > 0
    # Four blocks of 4 keys per query at most, though the context grows past 40.
    assert 0 < keys / queries <= 16
