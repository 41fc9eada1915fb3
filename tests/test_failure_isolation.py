"""One bad request never harms the others: when a step fails, the engine reruns its
requests one at a time, fails only the one that fails alone, and stays usable."""

from __future__ import annotations

import pytest

from tests.engine_run import run_staggered
from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine import LLMEngine
from tokenmill.runner.sampling import StepSampler

PROMPTS = [[5, 17, 42, 99, 3], list(range(20, 41)), [7, 7, 7, 8], [300, 12, 14]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
# The injected bug fires for requests with this seed: a failure tied to one request.
BAD = SamplingParams(temperature=1.0, seed=666, max_tokens=12, ignore_eos=True)


@pytest.fixture
def poisoned(monkeypatch):
    real = StepSampler.run

    def run(self, requests, *args, **kwargs):
        if any(r.sampling is not None and r.sampling.params.seed == 666 for r in requests):
            raise RuntimeError("injected failure for seed 666")
        return real(self, requests, *args, **kwargs)

    monkeypatch.setattr(StepSampler, "run", run)


def test_the_others_finish_with_the_tokens_they_would_have_had(llama_dir, request):
    params = [GREEDY, SEEDED, GREEDY, SEEDED]
    engine = LLMEngine.from_kwargs(str(llama_dir), progress=False, block_size=8)
    reference = run_staggered(engine, PROMPTS, params, arrivals=[0, 0, 1, 2])
    request.getfixturevalue("poisoned")
    engine = LLMEngine.from_kwargs(str(llama_dir), progress=False, block_size=8)
    finals = {}
    for index, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(f"r{index}", prompt, p)
    engine.add_request("bad", PROMPTS[1], BAD)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.check_integrity()
    failed = finals.pop("bad")
    assert failed.outputs[0].finish_reason == "error"
    assert "injected failure for seed 666" in failed.error
    assert [finals[f"r{i}"].outputs[0].token_ids for i in range(4)] == reference
    assert all(output.error is None for output in finals.values())
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    # The engine stays usable: the failed request is gone, a new one runs.
    engine.add_request("after", PROMPTS[0], GREEDY)
    assert engine.run_to_completion()["after"].outputs[0].token_ids == reference[0]


def test_offline_generate_reports_the_failed_request_and_keeps_going(llama_dir, poisoned):
    llm = LLM(str(llama_dir), progress=False)
    outputs = llm.generate(PROMPTS[:3], [GREEDY, BAD, GREEDY])
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "length"]
    assert outputs[1].error is not None and outputs[0].error is None
    again = llm.generate(PROMPTS[:1], GREEDY)
    assert again[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert again[0].error is None
