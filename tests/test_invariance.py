"""Paths that must not change numerics give the same greedy tokens as the plain path."""

from __future__ import annotations

import pytest

from tests.engine_run import run_staggered
from tokenmill import SamplingParams
from tokenmill.engine.engine import LLMEngine

PROMPTS = [list(range(3, 3 + n)) for n in (5, 23, 40, 61, 17, 90)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def make_engine(model_dir, **options) -> LLMEngine:
    options.setdefault("block_size", 8)
    return LLMEngine.from_kwargs(str(model_dir), progress=False, **options)


def run_alone(engine: LLMEngine, prompt: list[int], params=GREEDY) -> list[int]:
    engine.add_request("alone", prompt, params)
    out = engine.run_to_completion()["alone"]
    engine.check_integrity()
    return out.outputs[0].token_ids


@pytest.fixture(scope="module")
def reference(llama_dir) -> list[list[int]]:
    engine = make_engine(llama_dir, enable_prefix_caching=False, enable_chunked_prefill=False,
                         max_num_batched_tokens=512)
    return [run_alone(engine, p) for p in PROMPTS]


def run_all(engine: LLMEngine, arrivals: dict[int, int] | None = None) -> list[list[int]]:
    """Add prompt i at step arrivals[i] (default: all at step 0); step until done."""
    steps = [arrivals[i] for i in range(len(PROMPTS))] if arrivals else None
    return run_staggered(engine, PROMPTS, GREEDY, steps, max_steps=2000)


def test_staggered_batch_matches_each_alone(llama_dir, reference):
    engine = make_engine(llama_dir, max_num_batched_tokens=128)
    arrivals = {0: 0, 1: 0, 2: 3, 3: 5, 4: 9, 5: 14}
    assert run_all(engine, arrivals) == reference


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_unchunked(llama_dir, reference, chunk):
    engine = make_engine(llama_dir, chunk_size=chunk, max_num_batched_tokens=max(chunk * 2, 16),
                         enable_prefix_caching=False)
    assert run_all(engine) == reference


def test_dynamic_chunk_policy_matches_unchunked(llama_dir, reference):
    engine = make_engine(llama_dir, chunk_policy="dynamic", dynamic_chunk_threshold=32,
                         dynamic_max_chunks=3)
    assert run_all(engine) == reference


def test_prefix_cache_hit_matches_miss(llama_dir, reference):
    engine = make_engine(llama_dir)
    shared = PROMPTS[5]
    first = run_alone(engine, shared)
    second = run_alone(engine, shared)
    assert first == second == reference[5]
    assert engine.kv_manager.prefix_hits > 0
    # A prompt sharing only a prefix hits the cache for the shared full blocks.
    extended = shared[:48] + [11, 12, 13]
    engine.add_request("ext", extended, GREEDY)
    hit = engine.run_to_completion()["ext"]
    assert hit.num_cached_tokens == 48
    cold = make_engine(llama_dir, enable_prefix_caching=False)
    assert hit.outputs[0].token_ids == run_alone(cold, extended)


def test_preemption_matches_large_pool(llama_dir, reference):
    # 6 requests of up to 114 tokens in 8-token blocks; 20 blocks hold ~2 at a time.
    engine = make_engine(llama_dir, num_blocks=20, max_num_batched_tokens=256)
    assert run_all(engine) == reference
    assert engine.scheduler.num_preemptions > 0


def test_n_siblings_share_prompt_blocks(llama_dir, reference):
    engine = make_engine(llama_dir)
    params = SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True)
    engine.add_request("group", PROMPTS[5], params)
    out = engine.run_to_completion()["group"]
    assert [c.token_ids for c in out.outputs] == [reference[5]] * 3
    # Siblings after the first reuse every full prompt block.
    full_blocks = (len(PROMPTS[5]) - 1) // 8
    assert engine.kv_manager.prefix_hits == 2 * full_blocks * 8
