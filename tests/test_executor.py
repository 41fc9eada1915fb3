"""The executor boundary: a worker in a child process, reached only with plain step
data, gives token-identical output to the in-process worker, and its death is a clear
error, not a hang."""

from __future__ import annotations

import pickle
import time

import pytest

from tests.engine_run import run_staggered
from tokenmill import SamplingParams
from tokenmill.core.step import build_step
from tokenmill.engine.engine import LLMEngine
from tokenmill.executor.base import WorkerDiedError

PROMPTS = [[5, 17, 42, 99, 3], list(range(20, 61)), [7, 7, 7, 8, 7, 7, 7, 8, 7], [300, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=16, logprobs=2)
          for s in range(len(PROMPTS))]


def outputs(model_dir, params, **options) -> list[list[int]]:
    engine = LLMEngine.from_kwargs(str(model_dir), progress=False, block_size=8, **options)
    try:
        return run_staggered(engine, PROMPTS, params, arrivals=[0, 0, 2, 5])
    finally:
        engine.shutdown()


@pytest.mark.parametrize("options", [
    {},
    {"kv_cache_dtype": "int8", "max_num_batched_tokens": 16},
    {"speculative_method": "ngram", "prompt_lookup_min": 1, "spec_adaptive": False},
    {"speculative_method": "draft", "spec_adaptive": False},
], ids=["dense", "int8-kv-chunked", "ngram", "draft"])
def test_multiprocess_worker_is_token_identical_to_in_process(llama_dir, options):
    if options.get("speculative_method") == "draft":
        options = {**options, "speculative_model": str(llama_dir)}
    for params in (GREEDY, SEEDED):
        alone = outputs(llama_dir, params, **options)
        assert outputs(llama_dir, params, executor="multiprocess", **options) == alone


def test_step_data_is_plain_and_survives_pickling(llama_dir):
    """What crosses the boundary holds no engine object: pickling it and back gives the
    worker the same step."""
    engine = LLMEngine.from_kwargs(str(llama_dir), progress=False, block_size=8)
    engine.add_request("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=3,
                                                       repetition_penalty=1.2,
                                                       prompt_logprobs=1))
    step = build_step(engine.scheduler.schedule(), engine.kv_manager)
    copy = pickle.loads(pickle.dumps(step))
    assert copy == step
    assert copy.requests[0].sampling.prompt_token_ids == PROMPTS[1]  # penalties read them
    # Run twice on the same slots: the same K/V written, the same token and logprobs.
    assert engine.executor.execute(copy) == engine.executor.execute(step)


def test_a_dead_worker_fails_the_step_with_a_clear_error(llama_dir):
    engine = LLMEngine.from_kwargs(str(llama_dir), progress=False, executor="multiprocess")
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.step()
    engine.executor._processes[0].kill()
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="exited"):
        engine.step()
    assert time.monotonic() - started < 10
    with pytest.raises(WorkerDiedError):
        engine.step()
    engine.shutdown()
