"""`tokenmill tune --scheduler`: the token budget, block size and attention backend
measured per setting on a model, the fastest named, the table stored per host and model
shape and reported."""

from __future__ import annotations

import json

import pytest

import tokenmill.bench.tune_scheduler as tune_scheduler
from tokenmill.cli import main


def result(budget: int, block: int, rate: float) -> dict:
    return {"max_num_batched_tokens": budget, "block_size": block, "output_tok_s": rate,
            "ttft_ms": 1.0, "tpot_ms": 1.0, "steps": 1}


def test_the_fastest_setting_is_chosen_and_ties_keep_the_first():
    results = [result(512, 16, 10.0), result(1024, 16, 12.5), result(2048, 16, 12.5),
               result(512, 32, 9.0)]
    assert tune_scheduler.choose_setting(results) is results[1]


def test_values_must_be_positive_integers():
    assert tune_scheduler.parse_values("512,1024", "--budgets") == (512, 1024)
    for bad in ("", "0,16", "16,x", "-4"):
        with pytest.raises(ValueError, match="--budgets"):
            tune_scheduler.parse_values(bad, "--budgets")


def test_each_setting_serves_the_workload_and_the_table_is_stored(tmp_path, monkeypatch,
                                                                   capsys, llama_dir):
    monkeypatch.setattr(tune_scheduler, "CACHE", tmp_path)
    common = ["tune", "--scheduler", "--model", str(llama_dir), "--threads", "1"]
    assert main([*common, "--report"]) == 1  # nothing measured yet
    assert main([*common, "--budgets", "8,64", "--block-sizes", "4,16", "--num-requests", "3",
                 "--input-len", "20", "--output-len", "3",
                 "--attention-backends", "paged,paged-native"]) == 0
    out = capsys.readouterr().out
    assert "| token budget | block size |" in out and "fastest: --max-num-batched-tokens" in out
    [path] = (tmp_path / "scheduler").glob("*-1t.json")
    entry = json.loads(path.read_text())
    settings = [(r["max_num_batched_tokens"], r["block_size"], r["attention_backend"])
                for r in entry["results"]]
    assert settings == [(b, s, a) for b in (8, 64) for s in (4, 16)
                        for a in ("paged", "paged-native")]
    assert entry["choice"] == max(entry["results"], key=lambda r: r["output_tok_s"])
    assert all(r["output_tok_s"] > 0 for r in entry["results"])
    # The budget reached the engine: 3 prompts of 20 tokens take more steps in 8-token
    # steps than in 64-token ones.
    steps = {s: r["steps"] for s, r in zip(settings, entry["results"], strict=True)}
    assert steps[(8, 16, "paged-native")] > steps[(64, 16, "paged-native")]
    assert main([*common, "--report"]) == 0
    assert "fastest: --max-num-batched-tokens" in capsys.readouterr().out
    assert main([*common, "--budgets", "0"]) == 2
    assert "--budgets" in capsys.readouterr().err
    assert main([*common, "--num-requests", "0"]) == 2
    assert main([*common, "--attention-backends", "paged,nonesuch"]) == 2
    assert "nonesuch" in capsys.readouterr().err
