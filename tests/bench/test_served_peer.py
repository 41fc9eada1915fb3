"""The tokenmill-serve peer: the compare's first engine served over HTTP beside it."""

from __future__ import annotations

import json

from tokenmill.bench import peers as peers_module
from tokenmill.bench.peer_registry import available_peers
from tokenmill.bench.served_peer import TokenmillServePeer, engine_flags
from tokenmill.cli import main


def test_engine_options_become_serve_flags():
    assert engine_flags({"cpu_blas": "native", "chunk_size": 8, "huge_pages": False,
                         "enable_prefix_caching": True, "num_threads": None}) == [
        "--cpu-blas", "native", "--chunk-size", "8", "--no-huge-pages",
        "--enable-prefix-caching"]
    peer = TokenmillServePeer()
    peer.options = {"chunk_size": 8, "num_threads": 1}
    cmd, env = peer.server_command("/m", 1234, 4, 2, 512)
    assert env == {} and cmd[1:4] == ["-m", "tokenmill", "serve"]
    # the compare's own options win over the defaults the peer fills in
    assert cmd[cmd.index("--num-threads") + 1] == "1" and cmd.count("--num-threads") == 1
    assert cmd[cmd.index("--model") + 1] == "/m" and "--chunk-size" in cmd
    assert [p.name for p in available_peers(["tokenmill-serve"], log=lambda m: None)] == [
        "tokenmill-serve"]


def test_compare_serves_its_first_config_as_a_peer(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(peers_module, "PEERS_DIR", tmp_path / "peers")
    out_dir = tmp_path / "cmp"
    assert main(["bench", "compare", "--model", str(llama_dir),
                 "--configs", "small:chunk_size=8,max_num_batched_tokens=32",
                 "--peers", "tokenmill-serve", "--concurrency", "2", "--repeats", "1",
                 "--num-requests", "4", "--input-len", "16", "--output-len", "6",
                 "--num-threads", "1", "--log-level", "error", "--no-ceilings",
                 "--out-dir", str(out_dir)]) == 0
    report = (out_dir / "report.md").read_text()
    peer_line = next(line for line in report.splitlines()
                     if line.startswith("- peer tokenmill-serve"))
    assert "--chunk-size 8 --max-num-batched-tokens 32" in peer_line
    assert "| tokenmill-serve |" in report
    results = {r["system"]: r for r in json.loads((out_dir / "results.json").read_text())[
        "results"]}
    served = results["tokenmill-serve"]["pooled"]
    assert served["completed"] == 4 and served["failed"] == 0
    # every request produced its 6 tokens over HTTP, as in-process
    assert served["output_tokens"] == results["small"]["pooled"]["output_tokens"] == 24


def test_the_report_flags_a_system_whose_streams_arrived_whole():
    from tokenmill.bench.metrics import RequestRecord, summarize
    from tokenmill.bench.report import WHOLE_STREAM_NOTE, SystemResult, markdown_table

    def record(i: int, chunks: int) -> RequestRecord:
        # 8 tokens, in 8 chunks of one or in one chunk at the end (usage-corrected)
        times = [1.0 + t for t in range(8)][-chunks:]
        return RequestRecord(f"r{i}", 16, 0.0, chunk_times=times, chunk_tokens=[1] * chunks,
                             end_time=8.0, reported_output_tokens=8)

    results = []
    for name, chunks in (("per-token", 8), ("whole", 1)):
        records = [record(i, chunks) for i in range(4)]
        results.append(SystemResult(name, 2, [summarize(records, 8.0)], records))
    table = markdown_table(results, "per-token")
    assert f"- whole: {WHOLE_STREAM_NOTE}" in table
    assert "- per-token:" not in table
