"""The `tokenmill bench` and `tokenmill profile` commands end to end on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.server.conftest import API_KEY, MODEL_NAME, start_server
from tokenmill.bench import peer_install
from tokenmill.bench import peers as peers_module
from tokenmill.bench.compare import build_configs, parse_config
from tokenmill.bench.peer_registry import available_peers, peer_name
from tokenmill.bench.peers import LlamaCppPeer, VllmPeer
from tokenmill.cli import main

ENGINE = ["--num-threads", "1", "--log-level", "error"]
SMALL = ["--num-requests", "4", "--input-len", "16", "--output-len", "6"]


def test_throughput_writes_json_with_roofline(llama_dir, tmp_path, monkeypatch):
    from tokenmill.bench import ceilings, throughput

    monkeypatch.setattr(throughput, "machine_ceilings",
                        lambda threads: ceilings.Ceilings(20.0, 100.0, threads, "test"))
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", str(llama_dir), *SMALL, *ENGINE,
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["summary"]["completed"] == 4
    assert result["summary"]["output_tokens"] == 24
    assert 0 < result["roofline"]["efficiency"]
    assert len(result["requests"]) == 4


def test_latency_reports_each_batch_size(llama_dir, tmp_path):
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", str(llama_dir), "--batch-sizes", "1,3",
                 "--input-len", "8", "--output-len", "4", "--repeats", "2", *ENGINE,
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["batch_size"] for r in rows] == [1, 3]
    assert all(r["ttft_ms"] > 0 and r["tpot_ms"] > 0 for r in rows)


def test_profile_writes_trace_and_summary(llama_dir, tmp_path):
    trace, summary = tmp_path / "trace.json", tmp_path / "summary.json"
    assert main(["profile", "--model", str(llama_dir), *SMALL, *ENGINE, "--out", str(trace),
                 "--summary-json", str(summary), "--torch-profile-steps", "2"]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "phase" and e["name"] == "forward" for e in events)
    shares = json.loads(summary.read_text())["shares_percent"]
    assert sum(shares.values()) == pytest.approx(100.0)
    assert json.loads(trace.with_suffix(".torch.json").read_text())["traceEvents"]


def test_compare_writes_report_and_plots_for_two_configs(llama_dir, tmp_path, monkeypatch,
                                                         capsys):
    monkeypatch.setattr(peers_module, "PEERS_DIR", tmp_path / "no-peers")
    monkeypatch.setattr(peers_module.shutil, "which", lambda name: None)
    out_dir = tmp_path / "cmp"
    assert main(["bench", "compare", "--model", str(llama_dir), "--configs", "base:",
                 "small-chunks:chunk_size=8,max_num_batched_tokens=32",
                 "--peers", "llamacpp,vllm", "--concurrency", "2,all", "--repeats", "2",
                 *SMALL, *ENGINE, "--no-ceilings", "--out-dir", str(out_dir)]) == 0
    report = (out_dir / "report.md").read_text()
    assert "| small-chunks |" in report and "out tok/s vs base" in report
    assert "- cpu: " in report and "ceilings" not in report
    assert "skipped: llamacpp (not installed)" in report
    for name in ("latency_cdf.png", "throughput_vs_concurrency.png", "ttft_vs_tpot.png"):
        assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out_dir / "results.json").read_text())["results"]
    assert {(r["system"], r["concurrency"]) for r in results} == {
        ("base", 2), ("base", None), ("small-chunks", 2), ("small-chunks", None)}
    assert all(len(r["repetitions"]) == 2 for r in results)
    assert "not installed" in capsys.readouterr().out


def test_bench_serve_command_writes_json(llama_dir, tmp_path):
    server = start_server(llama_dir, tmp_path)
    try:
        out = tmp_path / "serve.json"
        assert main(["bench", "serve", "--base-url", server.url, "--model", MODEL_NAME,
                     "--tokenizer", str(llama_dir), "--api-key", API_KEY, "--concurrency", "2",
                     "--warmup", "1", *SMALL, "--out", str(out)]) == 0
    finally:
        server.stop()
    saved = json.loads(out.read_text())
    assert saved["summary"]["completed"] == 4 and saved["summary"]["failed"] == 0


def test_config_specs_parse_and_validate():
    assert parse_config("off:enable_chunked_prefill=false,chunk-size=256").options == {
        "enable_chunked_prefill": False, "chunk_size": 256}
    assert parse_config("plain").options == {}
    configs = build_configs({"max_num_seqs": 4}, ["a:", "b:block_size=32"])
    assert configs[1][1].cache.block_size == 32 and configs[1][1].scheduler.max_num_seqs == 4
    with pytest.raises(ValueError, match="unique"):
        build_configs({}, ["a:", "a:block_size=32"])
    with pytest.raises(ValueError, match="unknown engine option"):
        build_configs({}, ["a:no_such_knob=1"])


def test_absent_peers_are_skipped_with_a_message(tmp_path, monkeypatch):
    monkeypatch.setattr(peers_module, "PEERS_DIR", tmp_path)
    monkeypatch.setattr(peers_module.shutil, "which", lambda name: None)
    monkeypatch.setattr(peer_install, "TCMALLOC_PATTERNS", (str(tmp_path / "none*"),))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert LlamaCppPeer().detect() is None and VllmPeer().detect() is None
    messages: list[str] = []
    found = available_peers(["llamacpp", "vllm", "transformers"], log=messages.append)
    assert [p.name for p in found] == ["transformers"]
    assert sum("not installed" in m for m in messages) == 2
    with pytest.raises(ValueError, match="unknown peer"):
        available_peers(["nope"])
    # llama.cpp in another GGUF type is a peer of its own name (and its own file).
    q8 = LlamaCppPeer("q8_0")
    assert (q8.name, q8.outtype, LlamaCppPeer().name) == ("llamacpp-q8_0", "q8_0", "llamacpp")
    assert [peer_name(s) for s in ("llamacpp:q8_0", "llamacpp:f32", "vllm")] == \
        [q8.name, "llamacpp", "vllm"]  # what compare matches to report a peer as skipped
    # vLLM runs with its documented CPU settings: workers bound one per core.
    vllm = VllmPeer()
    _, env = vllm.server_command("m", 8000, 8, threads=2, max_model_len=1024)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["OMP_NUM_THREADS"] == "2"
    # The report names each peer's settings: those of the server it last started.
    assert vllm.describe() == "vllm"
    vllm._command = vllm.server_command("m", 8000, 8, threads=2, max_model_len=1024)
    assert vllm.describe().startswith("vllm, run as `VLLM_CPU_KVCACHE_SPACE=4 ")
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1" in vllm.describe()
    assert "--dtype float32 --max-model-len 1024" in vllm.describe()
    assert "not preloaded, as vLLM's CPU guide asks: libtcmalloc, libiomp" in vllm.describe()
    with pytest.raises(ValueError, match="GGUF type"):
        available_peers(["llamacpp:q3"])
    with pytest.raises(ValueError, match="unknown peer"):
        available_peers(["vllm:f16"])


def test_vllm_peer_preloads_what_its_cpu_guide_asks(tmp_path, monkeypatch):
    monkeypatch.setattr(peers_module, "PEERS_DIR", tmp_path)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    tcmalloc.touch()
    monkeypatch.setattr(peer_install, "TCMALLOC_PATTERNS", (str(tmp_path / "none*"),
                                                            str(tcmalloc) + "*"))
    monkeypatch.setattr(peer_install.platform, "machine", lambda: "x86_64")
    vllm = VllmPeer()
    (vllm.venv / "lib").mkdir(parents=True)
    (vllm.venv / "lib" / "libiomp5.so").touch()
    vllm._command = vllm.server_command("m", 8000, 8, threads=2, max_model_len=1024)
    iomp = vllm.venv / "lib" / "libiomp5.so"
    assert vllm._command[1]["LD_PRELOAD"] == f"{tcmalloc}:{iomp}"
    assert f"LD_PRELOAD={tcmalloc}:{iomp}" in vllm.describe()
    assert "not preloaded" not in vllm.describe()
    # Without Intel OpenMP in the venv the report says what the peer ran without.
    iomp.unlink()
    vllm._command = vllm.server_command("m", 8000, 8, threads=2, max_model_len=1024)
    assert vllm._command[1]["LD_PRELOAD"] == str(tcmalloc)
    assert vllm.describe().endswith("not preloaded, as vLLM's CPU guide asks: libiomp "
                                    "(libtcmalloc: apt install libtcmalloc-minimal4)")
    # A preload of the caller's own wins.
    monkeypatch.setenv("LD_PRELOAD", "/opt/mine.so")
    assert vllm.server_command("m", 8000, 8, 2, 1024)[1]["LD_PRELOAD"] == "/opt/mine.so"


def test_transformers_peer_times_every_token_of_every_request(llama_dir):
    from tokenmill.bench.peers import TransformersPeer
    from tokenmill.bench.workload import WorkloadSpec, build_workload

    workload = build_workload(WorkloadSpec(num_requests=3, input_len=10, output_len=5,
                                           length_dist="uniform", seed=2), 384)
    run = TransformersPeer(batch_size=2).run(str(llama_dir), workload, None, threads=1,
                                             progress=False)
    assert [r.output_tokens for r in run.records] == [r.max_tokens for r in workload]
    # the second batch waited for the first: its TTFT includes that queueing
    assert run.records[2].ttft > run.records[0].ttft
    assert all(r.success and r.e2e >= r.ttft for r in run.records)


def test_transformers_peer_runs_on_the_engines_device_and_dtype(llama_dir):
    from tokenmill.bench.peer_registry import place_peers
    from tokenmill.bench.peers import TransformersPeer
    from tokenmill.bench.workload import WorkloadSpec, build_workload

    llama_cpp, peer = LlamaCppPeer(), TransformersPeer()
    place_peers([llama_cpp, peer], "auto", "auto", {})
    assert (peer.device, peer.dtype) == ("cpu", "float32")  # auto, as the engine resolves
    place_peers([llama_cpp, peer], "cpu", "bfloat16", {})
    assert (peer.device, peer.dtype) == ("cpu", "bfloat16")
    assert ", cpu, bfloat16, " in peer.describe()
    workload = build_workload(WorkloadSpec(num_requests=2, input_len=6, output_len=3), 384)
    run = peer.run(str(llama_dir), workload, None, threads=1, progress=False)
    assert next(peer._loaded[1].parameters()).dtype == torch.bfloat16
    assert [r.output_tokens for r in run.records] == [3, 3]
    place_peers([peer], "cpu", "float32", {})  # placed again: not the cached model
    peer.run(str(llama_dir), workload, None, threads=1, progress=False)
    assert next(peer._loaded[1].parameters()).dtype == torch.float32


def test_a_peer_that_fails_to_start_is_skipped_not_fatal(llama_dir):
    from tokenmill.bench.compare import run_compare
    from tokenmill.bench.peers import Peer
    from tokenmill.bench.workload import WorkloadSpec, build_workload
    from tokenmill.engine.engine import LLMEngine

    class BrokenPeer(Peer):
        name = "broken"

        def detect(self):
            return "broken"

        def prepare(self, *args):
            raise RuntimeError("cannot start")

        def run(self, *args, **kwargs):
            raise AssertionError("never run")

    engine = LLMEngine.from_kwargs(str(llama_dir), progress=False, num_threads=1)
    skipped: list[str] = []
    results = run_compare([("base", engine)], [BrokenPeer()], str(llama_dir),
                          lambda i: build_workload(WorkloadSpec(num_requests=2, input_len=4,
                                                                output_len=2, seed=i), 384),
                          [None], 1, progress=False, skipped=skipped)
    assert [r.system for r in results] == ["base"]
    assert skipped == ["broken (failed to start: cannot start)"]


def test_server_peer_starts_loads_and_stops_its_server(llama_dir, tmp_path, monkeypatch):
    """The HTTP peer machinery, with tokenmill's own server standing in for a peer."""
    import os
    import sys

    from tokenmill.bench.peers import ServerPeer
    from tokenmill.bench.workload import WorkloadSpec, build_workload

    monkeypatch.setattr(peers_module, "PEERS_DIR", tmp_path)

    class TokenmillServerPeer(ServerPeer):
        name = "tokenmill-server"
        served_name = "stand-in"

        def detect(self):
            return "here"

        def server_command(self, model_dir, port, max_concurrency, threads, max_model_len):
            repo = str(Path(__file__).resolve().parents[2])
            return ([sys.executable, "-m", "tokenmill.server", "--model", model_dir,
                     "--port", str(port), "--served-model-name", self.served_name,
                     "--num-threads", str(threads), "--max-num-seqs", str(max_concurrency),
                     "--log-level", "warning"], {"PYTHONPATH": repo,
                                                 "PATH": os.environ.get("PATH", "")})

    peer = TokenmillServerPeer()
    workload = build_workload(WorkloadSpec(num_requests=3, input_len=8, output_len=4), 384,
                              avoid_token_ids=frozenset({0}))
    run = peer.run(str(llama_dir), workload, 2, threads=1, progress=False)
    assert peer._process is None  # started and stopped within run()
    assert [r.success for r in run.records] == [True] * 3, [r.error for r in run.records]
    assert [r.output_tokens for r in run.records] == [4, 4, 4]


def test_host_description_names_the_cpu_its_isa_and_the_cap(monkeypatch, tmp_path):
    from tokenmill.bench import ceilings

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\n"
                       "flags\t\t: fpu sse2 avx2 fma avx512f amx_tile\n")
    from tokenmill.layers import timing

    real_path = timing.Path
    monkeypatch.setattr(timing, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
    monkeypatch.delenv("TOKENMILL_ISA", raising=False)
    assert ceilings.host_description() == "Test CPU 9000; avx2 fma avx512f amx_tile"
    monkeypatch.setenv("TOKENMILL_ISA", "avx2")
    assert ceilings.host_description().endswith("; capped at avx2")
    assert ceilings.describe(ceilings.Ceilings(35.1, 459.6, 2, "x")) == \
        "459.6 GFLOP/s fp32 GEMM, 35.1 GB/s read (2 threads)"
