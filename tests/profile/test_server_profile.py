"""POST /start_profile and /stop_profile on a real server process."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, start_server


def test_start_stop_profile_writes_a_trace_of_served_steps(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_PROFILE_DIR", str(tmp_path / "profiles"))
    server = start_server(llama_dir, tmp_path, api_key=None)
    try:
        assert httpx.post(server.url + "/stop_profile").status_code == 400
        assert httpx.post(server.url + "/start_profile").json() == {"status": "started"}
        assert httpx.post(server.url + "/start_profile").status_code == 400
        reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": 5,
            "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200
        stopped = httpx.post(server.url + "/stop_profile", timeout=30).json()
        # Two profiles stopped within the same second get their own files.
        httpx.post(server.url + "/start_profile")
        again = httpx.post(server.url + "/stop_profile", timeout=30).json()
    finally:
        server.stop()
    assert again["trace_path"] != stopped["trace_path"]
    assert stopped["summary"]["num_steps"] >= 5
    assert sum(stopped["summary"]["shares_percent"].values()) == pytest.approx(100)
    events = json.loads(open(stopped["trace_path"]).read())["traceEvents"]
    assert sum(e.get("cat") == "step" for e in events) == stopped["summary"]["num_steps"]
