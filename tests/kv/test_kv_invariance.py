"""With a quantized KV cache, paths that must not change numerics still give the same
greedy tokens as the same cache dtype run one request at a time, unchunked."""

from __future__ import annotations

import pytest

from tests.test_invariance import GREEDY, PROMPTS, make_engine, run_all, run_alone

pytestmark = pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])

_references: dict[str, list[list[int]]] = {}


@pytest.fixture
def reference(llama_dir, kv_dtype) -> list[list[int]]:
    if kv_dtype not in _references:
        engine = make_engine(llama_dir, kv_cache_dtype=kv_dtype, enable_prefix_caching=False,
                             enable_chunked_prefill=False, max_num_batched_tokens=512)
        _references[kv_dtype] = [run_alone(engine, p) for p in PROMPTS]
    return _references[kv_dtype]


def test_quantized_staggered_batch_matches_each_alone(llama_dir, reference, kv_dtype):
    engine = make_engine(llama_dir, kv_cache_dtype=kv_dtype, max_num_batched_tokens=128)
    arrivals = {0: 0, 1: 0, 2: 3, 3: 5, 4: 9, 5: 14}
    assert run_all(engine, arrivals) == reference


@pytest.mark.parametrize("chunk", [5, 12])  # shorter and longer than a block
def test_quantized_chunked_prefill_matches_unchunked(llama_dir, reference, kv_dtype, chunk):
    engine = make_engine(llama_dir, kv_cache_dtype=kv_dtype, chunk_size=chunk,
                         max_num_batched_tokens=max(chunk * 2, 16), enable_prefix_caching=False)
    assert run_all(engine) == reference


def test_quantized_prefix_cache_hit_matches_miss(llama_dir, reference, kv_dtype):
    engine = make_engine(llama_dir, kv_cache_dtype=kv_dtype)
    shared = PROMPTS[5]
    assert run_alone(engine, shared) == run_alone(engine, shared) == reference[5]
    assert engine.kv_manager.prefix_hits > 0
    extended = shared[:48] + [11, 12, 13]
    engine.add_request("ext", extended, GREEDY)
    hit = engine.run_to_completion()["ext"]
    engine.check_integrity()
    assert hit.num_cached_tokens == 48
    cold = make_engine(llama_dir, kv_cache_dtype=kv_dtype, enable_prefix_caching=False)
    assert hit.outputs[0].token_ids == run_alone(cold, extended)


def test_quantized_preemption_matches_large_pool(llama_dir, reference, kv_dtype):
    engine = make_engine(llama_dir, kv_cache_dtype=kv_dtype, num_blocks=20,
                         max_num_batched_tokens=256)
    assert run_all(engine) == reference
    assert engine.scheduler.num_preemptions > 0


def test_quantized_cache_stores_one_byte_codes_and_scales(llama_dir, kv_dtype):
    engine = make_engine(llama_dir, kv_cache_dtype=kv_dtype)
    cache = engine.executor.worker.runner.kv_caches[0]
    assert cache.data.element_size() == 1
    assert cache.scales is not None and cache.scales.shape == cache.data.shape[:-1]
