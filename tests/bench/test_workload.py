"""Workloads are seeded, shaped as asked, and read from files and the stdlib."""

from __future__ import annotations

import json
import random
import statistics

import pytest
from transformers import AutoTokenizer

from tokenmill.bench.workload import WorkloadSpec, build_workload, sample_length


def test_same_seed_same_requests_different_seed_different():
    spec = WorkloadSpec(num_requests=8, input_len=20, length_dist="uniform", seed=3)
    assert build_workload(spec, 384) == build_workload(spec, 384)
    other = WorkloadSpec(num_requests=8, input_len=20, length_dist="uniform", seed=4)
    assert build_workload(spec, 384) != build_workload(other, 384)


def test_fixed_lengths_and_token_range():
    reqs = build_workload(WorkloadSpec(num_requests=5, input_len=16, output_len=7), 100,
                          avoid_token_ids=frozenset({5}))
    assert all(r.prompt_len == len(r.prompt) == 16 and r.max_tokens == 7 for r in reqs)
    assert all(0 < t < 100 and t != 5 for r in reqs for t in r.prompt)


def test_uniform_and_lognormal_lengths_stay_in_range():
    rng = random.Random(0)
    uniform = [sample_length(rng, 100, "uniform", 0.5) for _ in range(500)]
    assert min(uniform) >= 50 and max(uniform) <= 150
    lognormal = [sample_length(rng, 100, "lognormal", 0.5) for _ in range(2000)]
    assert 1 <= min(lognormal) and max(lognormal) <= 400
    assert 85 <= statistics.median(lognormal) <= 115


def test_jsonl_prompts_cycle_and_keep_max_tokens(tmp_path, llama_dir):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "def add(a, b):", "max_tokens": 5}) + "\n\n"
                    + json.dumps({"prompt": [3, 4, 5]}) + "\n")
    tok = AutoTokenizer.from_pretrained(llama_dir)
    reqs = build_workload(WorkloadSpec(source="jsonl", path=str(path), num_requests=3,
                                       output_len=9), 384, tok)
    assert [r.prompt for r in reqs] == ["def add(a, b):", [3, 4, 5], "def add(a, b):"]
    assert reqs[0].max_tokens == 5 and reqs[1].max_tokens == 9
    assert reqs[1].prompt_len == 3


def test_code_workload_is_stdlib_prefixes(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    reqs = build_workload(WorkloadSpec(source="code", num_requests=4, input_len=40), 384, tok)
    assert len(reqs) == 4
    assert all(isinstance(r.prompt, str) and 30 <= r.prompt_len <= 42 for r in reqs)


def test_bad_spec_fails_naming_the_field():
    with pytest.raises(ValueError, match="input_len"):
        WorkloadSpec(input_len=0)
    with pytest.raises(ValueError, match="path"):
        WorkloadSpec(source="jsonl")
