"""Expert-load statistics: every routed token counted once per layer and expert, the
same across processes and pipeline stages, windowed by time, and in /metrics."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, metric_value, start_server
from tokenmill import LLM, SamplingParams
from tokenmill.core.expert_load import ExpertLoad, imbalance

PROMPTS = [[5, 17, 42, 99, 3], list(range(20, 61))]
MAX_TOKENS = 8


def run(model_dir, **options) -> LLM:
    llm = LLM(str(model_dir), progress=False, **options)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return llm


def test_imbalance_is_max_over_mean():
    assert imbalance([10, 10, 10, 10]) == 1.0
    assert imbalance([34, 2, 2, 2]) == pytest.approx(3.4)
    assert imbalance([0, 0]) == 1.0


def test_the_window_keeps_only_recent_steps():
    load = ExpertLoad(window_s=1.0)
    load.record([[4, 0], [1, 3]], now=0.0)
    load.record([[0, 2], [2, 0]], now=0.6)
    assert load.window(now=0.9) == [[4, 2], [3, 3]]
    assert load.window(now=1.5) == [[0, 2], [2, 0]]  # the first step has left
    assert load.imbalance(now=1.5) == [2.0, 2.0]
    assert load.totals == [[4, 2], [3, 3]]
    with pytest.raises(ValueError, match="expert_stats_window_s"):
        ExpertLoad(window_s=-1)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_every_routed_token_is_counted(model_factory, family):
    llm = run(model_factory(family))
    engine = llm.engine
    # Each forwarded token (the prompts, then each output token but the last) goes to
    # top-k experts in every sparse layer; qwen2_moe's first layer is dense.
    forwarded = sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS)
    sparse = [i for i in range(engine.arch.num_layers) if engine.arch.is_sparse(i)]
    assert len(engine.expert_load.totals) == len(sparse)
    for layer in engine.expert_load.totals:
        assert sum(layer) == forwarded * engine.arch.num_experts_per_tok


def test_counts_are_the_same_across_processes_and_stages(model_factory):
    model_dir = model_factory("mixtral")
    single = run(model_dir).engine.expert_load.totals
    staged = run(model_dir, pipeline_parallel_size=2)
    try:
        assert staged.engine.expert_load.totals == single
    finally:
        staged.engine.shutdown()


def test_dense_models_report_nothing(llama_dir):
    assert run(llama_dir).engine.expert_load.totals == []


def test_metrics_show_expert_tokens_and_imbalance(model_factory, tmp_path):
    server = start_server(model_factory("mixtral"), tmp_path)
    try:
        body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0}
        response = httpx.post(server.url + "/v1/completions", json=body,
                              headers=server.auth_headers, timeout=60)
        assert response.status_code == 200, response.text
        text = httpx.get(server.url + "/metrics", timeout=5).text
        routed = sum(metric_value(text, "tokenmill:moe_expert_tokens_total", layer="0",
                                  expert=str(e)) for e in range(4))
        assert routed == (len(PROMPTS[1]) + 3) * 2
        assert metric_value(text, "tokenmill:moe_load_imbalance", layer="1") >= 1.0
    finally:
        server.stop()


def test_bench_moe_reports_each_layer(model_factory, tmp_path, capsys):
    import json

    from tokenmill.cli import main

    out = tmp_path / "moe"
    assert main(["bench", "moe", "--model", str(model_factory("mixtral")), "--num-requests",
                 "3", "--input-len", "8", "--output-len", "4", "--out", str(out)]) == 0
    report = json.loads((out / "moe.json").read_text())
    assert [row["tokens"] for row in report["layers"]] == [3 * (8 + 3) * 2] * 2
    assert all(row["imbalance"] >= 1.0 for row in report["layers"])
    assert (out / "moe.png").stat().st_size > 0
    assert "imbalance" in capsys.readouterr().out
    assert main(["bench", "moe", "--model", str(model_factory("llama"))]) == 2
