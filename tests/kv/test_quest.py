"""Quest and static top-k (`--attention-backend quest | static-topk`): the block bound
holds, the exact block score is the block's best key, the kept set follows the
selection rule, a budget that covers the context is dense attention token for token,
and a small budget still runs with chunked prefill, prefix caching, preemption and an
int8 cache without leaking a block."""

from __future__ import annotations

import pytest
import torch

from tests.engine_run import run_staggered
from tokenmill import SamplingParams
from tokenmill.attention.base import AttentionSpec
from tokenmill.attention.quest import StaticTopKAttention, block_upper_bounds, select_blocks
from tokenmill.config import AttentionConfig, EngineConfig, ModelConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.kv import KVCache

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [list(range(3, 90)), [5, 17, 42] * 20, list(range(100, 131))]


def test_the_bound_is_at_least_every_key_score_of_its_block():
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 10, 16, 2, 8, generator=generator)  # [D, W, block, KVH, Dh]
    q = torch.randn(3, 2, 4, 8, generator=generator)  # [D, KVH, G, Dh]
    bounds = block_upper_bounds(q, keys.amin(2), keys.amax(2))  # [D, W, KVH]
    scores = torch.einsum("dhgk,dwthk->dwhgt", q, keys)  # every key against every head
    best = scores.amax(-1).amax(-1)  # [D, W, KVH]
    assert (bounds >= best - 1e-5).all()
    # The bound is attained where a block holds a single key.
    single = block_upper_bounds(q, keys[:, :, 0], keys[:, :, 0])
    torch.testing.assert_close(single, scores[..., 0].amax(-1))


def test_static_topk_scores_blocks_by_their_best_key():
    generator = torch.Generator().manual_seed(1)
    cache = KVCache.allocate(12, 4, 2, 8, torch.float32, torch.float32, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=generator))
    backend = StaticTopKAttention(AttentionSpec(1, 4, 2, 8, 4))
    tables = torch.tensor([[7, 2, 9], [1, 0, 0]])
    lengths = torch.tensor([10, 3])
    q = torch.randn(2, 2, 2, 8, generator=generator)
    scores = backend.block_scores(0, q, tables, lengths, cache)
    for row in range(2):
        for logical, block in enumerate(tables[row].tolist()):
            for head in range(2):
                count = min(4, int(lengths[row]) - 4 * logical)
                if count <= 0:
                    assert scores[row, logical, head] == float("-inf")
                    continue
                keys = cache.data[0, block, :count, head]  # [count, Dh]
                best = (q[row, head] @ keys.t()).max()
                torch.testing.assert_close(scores[row, logical, head], best)


def reference_selection(bounds: torch.Tensor, num_blocks: list[int], keep: int) -> list:
    """The rule in plain Python: per (row, KV head), the first and last block, then the
    highest bounds, until `keep` blocks (all of them when the row has no more)."""
    chosen = []
    for row, count in enumerate(num_blocks):
        per_head = []
        for head in range(bounds.shape[2]):
            order = sorted(range(1, count - 1), key=lambda b: -bounds[row, b, head].item())
            kept = {0, count - 1} | set(order[:max(0, keep - 2)])
            per_head.append(sorted(kept))
        chosen.append(per_head)
    return chosen


@pytest.mark.parametrize("keep", [1, 3, 6, 20])
def test_the_kept_blocks_follow_the_rule(keep):
    generator = torch.Generator().manual_seed(keep)
    num_blocks = [12, 5, 1, 9]
    bounds = torch.randn(4, 12, 3, generator=generator)
    chosen = select_blocks(bounds, torch.tensor(num_blocks), keep)
    for row, heads in enumerate(reference_selection(bounds, num_blocks, max(keep, 2))):
        for head, expected in enumerate(heads):
            assert sorted(set(chosen[row, head].tolist())) == expected
            assert chosen[row, head].tolist() == sorted(chosen[row, head].tolist())


def run(model_dir, **options) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine.from_kwargs(str(model_dir), progress=False, block_size=4, **options)
    return run_staggered(engine, PROMPTS, GREEDY, arrivals=[0, 0, 3]), engine


@pytest.mark.parametrize("backend", ["quest", "static-topk"])
def test_a_budget_covering_the_context_is_dense_attention(model_factory, backend):
    model_dir = model_factory("llama")
    dense, _ = run(model_dir, attention_backend="paged")
    quest, engine = run(model_dir, attention_backend=backend, sparse_budget=512,
                        sparse_dense_layers=0)
    assert quest == dense
    backend = engine.executor.worker.runner.backend
    assert backend.queries > 0
    assert backend.active_tokens / backend.queries > 30  # whole contexts were attended


@pytest.mark.parametrize("backend", ["quest", "static-topk"])
def test_a_small_budget_attends_to_fewer_keys_and_composes(model_factory, backend):
    model_dir = model_factory("llama")
    options = dict(attention_backend=backend, sparse_budget=8, sparse_dense_layers=1,
                   max_num_batched_tokens=16, num_blocks=48, enable_prefix_caching=True)
    for kv in ("auto", "int8"):
        tokens, engine = run(model_dir, kv_cache_dtype=kv, **options)
        backend = engine.executor.worker.runner.backend
        # Two blocks of 4 per query: the sink block and the query's own (budget 8).
        assert backend.active_tokens / backend.queries <= 8
        assert all(len(t) == GREEDY.max_tokens for t in tokens)
        # (run_staggered checked integrity after every step and the whole pool free.)
        # Each step's counts reach the engine's stats (what /metrics publishes).
        assert engine.stats.sparse_attention_queries == backend.queries > 0
        assert engine.stats.sparse_attention_keys == backend.active_tokens


def test_quest_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="sparse_budget"):
        AttentionConfig(attention_backend="quest", sparse_budget=0)
    for backend in ("quest", "static-topk"):
        with pytest.raises(ValueError, match="attention_backend"):
            EngineConfig(model=ModelConfig(model="m", early_exit_layer=1),
                         attention=AttentionConfig(attention_backend=backend))
