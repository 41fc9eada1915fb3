"""A server on a sparse attention backend answers and counts what sparse attention
attended in /metrics, per head kind (keys and queries, so keys per query is their
ratio)."""

from __future__ import annotations

import httpx

from tests.server.conftest import MODEL_NAME, metric_value
from tokenmill.calibrate import calibrate_sparse

KEYS, QUERIES = "tokenmill:sparse_attention_keys_total", "tokenmill:sparse_attention_queries_total"


def complete(server) -> str:
    body = {"model": MODEL_NAME, "prompt": list(range(5, 45)), "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}
    response = httpx.post(server.url + "/v1/completions", json=body,
                          headers=server.auth_headers, timeout=60)
    assert response.status_code == 200, response.text
    return httpx.get(server.url + "/metrics", timeout=5).text


def test_quest_server_reports_keys_per_query(server_factory):
    text = complete(server_factory("--attention-backend", "quest", "--sparse-budget", "16",
                                   "--sparse-dense-layers", "0", "--block-size", "4"))
    keys = metric_value(text, KEYS, head_kind="selected")
    queries = metric_value(text, QUERIES, head_kind="selected")
    assert queries and queries > 0
    # Four blocks of 4 keys per query at most, though the context grows past 40.
    assert 0 < keys / queries <= 16
    for layer in ("0", "1"):  # each sparse layer has its own samples
        assert metric_value(text, QUERIES, layer=layer, head_kind="selected") == queries


def test_retrieval_topp_server_reports_each_head_kind(server_factory, llama_dir, tmp_path):
    path = tmp_path / "calibration.json"
    calibrate_sparse(llama_dir, sequences=1, length=96, copy_tokens=16, index_dims=4,
                     text="random").save(path)
    text = complete(server_factory(
        "--attention-backend", "retrieval-topp", "--sparse-calibration", str(path),
        "--sparse-dense-layers", "0", "--sparse-sink-tokens", "4", "--sparse-window", "8",
        "--sparse-min-tokens", "8", "--sparse-budget", "16", "--block-size", "4"))
    local = metric_value(text, KEYS, head_kind="local") / metric_value(
        text, QUERIES, head_kind="local")
    retrieval = metric_value(text, KEYS, head_kind="retrieval") / metric_value(
        text, QUERIES, head_kind="retrieval")
    assert 0 < local <= 16  # sinks and window only (whole blocks)
    assert 8 <= retrieval <= 16 + 12
