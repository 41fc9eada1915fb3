"""retrieval-topp (`--attention-backend retrieval-topp`) and its calibration: the top-p
rule and the floor / ceiling follow a plain reference, the calibration is
deterministic for a seed and finds a head built to copy, every block kept is dense
attention token for token, the index holds the calibrated key dimensions, and a small
budget composes with chunked prefill, prefix caching, preemption and an int8 cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tests.engine_run import run_staggered
from tokenmill import SamplingParams
from tokenmill.attention.base import AttentionSpec, BatchLayout, SparseSettings
from tokenmill.attention.block_sparse import BlockSparseAttention
from tokenmill.attention.paged import PagedAttention
from tokenmill.attention.registry import ATTENTION_BACKENDS
from tokenmill.attention.retrieval import clamp_blocks, top_p_blocks
from tokenmill.attention.sparse_calibration import (
    SparseCalibration,
    copy_attention_mass,
    pair_strength,
    strongest_pairs,
)
from tokenmill.calibrate import calibrate_sparse, needle_probes
from tokenmill.config import AttentionConfig, EngineConfig, ModelConfig, ParallelConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.kv import KVCache

PYCODER = Path(__file__).resolve().parents[2] / "models" / "pycoder"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [list(range(3, 90)), [5, 17, 42] * 20, list(range(100, 131))]


def test_top_p_keeps_the_fewest_blocks_that_reach_p():
    generator = torch.Generator().manual_seed(0)
    mass = torch.rand(5, 3, 9, generator=generator).softmax(-1)
    for p in (0.1, 0.5, 0.9, 1.0):
        kept = top_p_blocks(mass, p)
        for row in range(5):
            for head in range(3):
                values = mass[row, head].tolist()
                order = sorted(range(9), key=lambda b: -values[b])
                expected, total = set(), 0.0
                for block in order:
                    if total >= p:
                        break
                    expected.add(block)
                    total += values[block]
                found = set(kept[row, head].nonzero().flatten().tolist())
                assert found == expected
                assert sum(values[b] for b in found) >= min(p, 1.0) - 1e-6


def test_the_floor_and_ceiling_keep_forced_then_chosen_then_the_rest():
    generator = torch.Generator().manual_seed(1)
    width = 10
    priority = torch.rand(4, width, generator=generator)
    chosen = torch.rand(4, width, generator=generator) < 0.3
    forced = torch.zeros(4, width, dtype=torch.bool)
    forced[:, 0] = forced[:, -2:] = True
    valid = torch.ones(4, width, dtype=torch.bool)
    valid[3, 6:] = False
    forced[3] &= valid[3]
    for least, most in [(1, 10), (6, 10), (1, 4), (2, 2), (9, 9)]:
        kept = clamp_blocks(chosen & valid, forced, priority, valid, least, most)
        for row in range(4):
            blocks = [b for b in range(width) if valid[row, b]]
            rank = sorted(blocks, key=lambda b: (-int(forced[row, b]),
                                                  -int(chosen[row, b]), -priority[row, b]))
            count = int((chosen[row] & valid[row] | forced[row]).sum())
            count = min(max(count, least), max(most, int(forced[row].sum())), len(blocks))
            assert set(kept[row].nonzero().flatten().tolist()) == set(rank[:count])


def test_the_calibration_scores_copying_and_picks_strong_pairs():
    # A head attending from the second copy to the first scores its share there; a
    # sink head (position 0, before the first copy) scores nothing.
    attention = torch.zeros(2, 12, 12)
    attention[0, :, 0] = 1.0
    for i in (9, 10):
        attention[1, i, i - 6] = 1.0  # from the second copy back to its twin
    assert copy_attention_mass(attention, range(2, 5), range(8, 11)).tolist() == [0.0, 1.0]
    # Pairs: dims (m, m + Dh / 2); the strongest product of norms wins, per KV head.
    q = torch.zeros(5, 4, 8)
    k = torch.zeros(5, 2, 8)
    q[..., 1] = q[..., 5] = 3.0
    k[:, 0, 1] = k[:, 1, 3] = 2.0
    q[..., 3] = 1.0
    strength = pair_strength(q, k, 2)
    assert strongest_pairs(strength, 2) == [[1], [3]]


def test_calibration_is_deterministic_for_a_seed(model_factory):
    model_dir = model_factory("llama")
    options = {"sequences": 2, "length": 96, "copy_tokens": 16, "index_dims": 4,
               "text": "random"}
    first = calibrate_sparse(model_dir, seed=3, **options)
    again = calibrate_sparse(model_dir, seed=3, **options)
    other = calibrate_sparse(model_dir, seed=4, **options)
    assert first == again
    assert first.retrieval_score != other.retrieval_score
    assert all(len(pairs) == 2 for layer in first.index_pairs for pairs in layer)


def test_needle_probes_score_the_answer_on_the_fact_line():
    tokenizer = AutoTokenizer.from_pretrained(str(PYCODER))
    filler = ["\n".join(f"value_{i} = compute({i * 7}, 'x')" for i in range(400))]
    for probe in needle_probes(tokenizer, filler, 4, 300, seed=0):
        text = tokenizer.decode(probe.ids)
        asked = text.rsplit("assert KEY_", 1)[1]
        name, answer = asked.split(" == ")
        fact = tokenizer.decode([probe.ids[i] for i in probe.keys])
        assert probe.keys == list(range(probe.keys[0], probe.keys[-1] + 1))  # one line
        assert fact.strip() == f"KEY_{name} = {answer}"
        # The positions that predict the answer: "==" and the answer's tokens but its last.
        assert tokenizer.decode(probe.ids[probe.queries[0]]).strip() == "=="
        predicted = tokenizer.decode([probe.ids[i + 1] for i in probe.queries])
        assert predicted.strip() == answer and probe.queries[-1] == len(probe.ids) - 2


def test_the_needle_calibration_is_deterministic_and_names_its_probes():
    filler = ["\n".join(f"value_{i} = compute({i * 7}, 'x')" for i in range(400))]
    options = {"sequences": 2, "length": 256, "index_dims": 4, "texts": filler}
    first = calibrate_sparse(PYCODER, seed=1, **options)
    assert first == calibrate_sparse(PYCODER, seed=1, **options)
    assert first.method["score"].startswith("needle") and "copy_tokens" not in first.method
    assert all(0 <= s <= 1 for layer in first.retrieval_score for s in layer)
    assert any(s > 0 for layer in first.retrieval_score for s in layer)


def test_retrieval_heads_are_the_best_scored_of_the_sparse_layers():
    calibration = SparseCalibration(3, 2, 8, 4, [[0.9, 0.8], [0.1, 0.5], [0.3, 0.2]],
                                    [[[0, 1]] * 2] * 3, {})
    assert calibration.retrieval_heads(1, 0.25) == [[], [1], []]
    assert calibration.retrieval_heads(0, 0.5) == [[0, 1], [1], []]
    assert calibration.retrieval_heads(2, 0.01) == [[], [], [0]]
    assert calibration.index_dims_of(0, 0) == [0, 1, 4, 5]


@pytest.fixture(scope="module")
def calibrated(model_factory, tmp_path_factory):
    model_dir = model_factory("llama")
    path = tmp_path_factory.mktemp("calibration") / "sparse_calibration.json"
    calibrate_sparse(model_dir, seed=0, sequences=1, length=96, copy_tokens=16,
                     index_dims=4, text="random").save(path)
    return model_dir, str(path)


def run(model_dir, **options) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine.from_kwargs(str(model_dir), progress=False, block_size=4, **options)
    return run_staggered(engine, PROMPTS, GREEDY, arrivals=[0, 0, 3]), engine


def test_every_block_kept_is_dense_attention(calibrated):
    model_dir, path = calibrated
    dense, _ = run(model_dir, attention_backend="paged")
    # Every KV head retrieves and keeps at least the whole context.
    tokens, engine = run(model_dir, attention_backend="retrieval-topp", sparse_calibration=path,
                         sparse_dense_layers=0, sparse_retrieval_fraction=1.0,
                         sparse_min_tokens=512, sparse_budget=512)
    assert tokens == dense
    backend = engine.executor.worker.runner.backend
    assert set(backend.kind_counts) == {"retrieval"}
    # Local heads whose sinks and window cover the context: dense as well.
    tokens, engine = run(model_dir, attention_backend="retrieval-topp", sparse_calibration=path,
                         sparse_dense_layers=0, sparse_window=512)
    assert tokens == dense
    assert engine.executor.worker.runner.backend.kind_counts["local"][1] > 0


def test_the_index_holds_the_calibrated_key_dimensions(calibrated):
    model_dir, path = calibrated
    _, engine = run(model_dir, attention_backend="retrieval-topp", sparse_calibration=path,
                    sparse_dense_layers=0, enable_prefix_caching=False)
    runner = engine.executor.worker.runner
    backend = runner.backend
    checked = 0
    for layer, heads in enumerate(backend.retrieval):
        keys = runner.kv_caches[layer].data[0].flatten(0, 1)  # [slots, KVH, Dh]
        for position, head in enumerate(heads):
            dims = backend.index_dims[layer][position]
            written = backend.index[layer][:, position].abs().sum(-1) > 0
            assert written.sum() > 50
            torch.testing.assert_close(backend.index[layer][written, position],
                                       keys[written][:, head][:, dims])
            checked += 1
    assert checked >= 1
    assert backend.index_bytes_per_token() == 4 * sum(
        len(heads) * 4 for heads in backend.retrieval)


def test_a_small_budget_adapts_and_composes(calibrated):
    model_dir, path = calibrated
    options = dict(attention_backend="retrieval-topp", sparse_calibration=path,
                   sparse_dense_layers=1, sparse_sink_tokens=4, sparse_window=8,
                   sparse_min_tokens=8, sparse_budget=16, sparse_top_p=0.5,
                   sparse_retrieval_fraction=0.5, max_num_batched_tokens=16, num_blocks=48,
                   enable_prefix_caching=True)
    for kv in ("auto", "int8"):
        tokens, engine = run(model_dir, kv_cache_dtype=kv, **options)
        backend = engine.executor.worker.runner.backend
        local_keys, local_queries = backend.kind_counts["local"]
        retrieval_keys, retrieval_queries = backend.kind_counts["retrieval"]
        # Sinks and window only: one block of 4, and the blocks of the last 8 tokens.
        assert local_keys / local_queries <= 4 + 12
        # The floor and the ceiling (block aligned: up to the window's partial block).
        assert 8 <= retrieval_keys / retrieval_queries <= 16 + 4 + 8
        assert all(len(t) == GREEDY.max_tokens for t in tokens)
        assert engine.stats.sparse_attention_queries == backend.queries > 0


def test_retrieval_topp_refuses_what_it_cannot_do(model_factory, tmp_path):
    model_dir = model_factory("llama")
    with pytest.raises(ValueError, match="sparse_calibration"):
        LLMEngine.from_kwargs(str(model_dir), progress=False,
                              attention_backend="retrieval-topp",
                              sparse_calibration=str(tmp_path / "missing.json"))
    wrong = SparseCalibration(3, 2, 16, 4, [[0.1, 0.2]] * 3, [[[0, 1]] * 2] * 3, {})
    wrong.save(tmp_path / "wrong.json")
    with pytest.raises(ValueError, match="sparse_calibration"):
        LLMEngine.from_kwargs(str(model_dir), progress=False,
                              attention_backend="retrieval-topp",
                              sparse_calibration=str(tmp_path / "wrong.json"))
    for field, value in [("sparse_top_p", 0.0), ("sparse_top_p", 1.5), ("sparse_window", 0),
                         ("sparse_retrieval_fraction", 0), ("sparse_min_tokens", -1)]:
        with pytest.raises(ValueError, match=field):
            AttentionConfig(attention_backend="retrieval-topp", **{field: value})
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model=ModelConfig(model="m"),
                     attention=AttentionConfig(attention_backend="retrieval-topp"),
                     parallel=ParallelConfig(tensor_parallel_size=2))


@pytest.mark.parametrize("backend", ["retrieval-topp", "quest"])
def test_the_in_place_route_equals_the_gathered_one(calibrated, backend, monkeypatch):
    model_dir, path = calibrated
    options = dict(attention_backend=backend, sparse_calibration=path, sparse_dense_layers=1,
                   sparse_sink_tokens=4, sparse_window=8, sparse_min_tokens=8,
                   sparse_budget=16, sparse_top_p=0.5, sparse_retrieval_fraction=0.5)
    in_place, engine = run(model_dir, **options)
    counted = dict(engine.executor.worker.runner.backend.kind_counts)
    monkeypatch.setattr(BlockSparseAttention, "in_place", False)
    gathered, engine = run(model_dir, **options)
    assert in_place == gathered
    assert engine.executor.worker.runner.backend.kind_counts == counted


def batch_of_rows(backend, cache, lengths: list[int], generator):
    """Metadata for one decode token per row at the given key counts, each row's blocks
    scattered through the pool, and random queries [D, H, Dh]."""
    block_size = backend.spec.block_size
    order = torch.randperm(cache.data.shape[1], generator=generator).tolist()
    tables, slots = [], []
    for length in lengths:
        blocks = [order.pop() for _ in range((length + block_size - 1) // block_size)]
        tables.append(blocks)
        slots.append(blocks[(length - 1) // block_size] * block_size + (length - 1) % block_size)
    starts = list(range(len(lengths) + 1))
    layout = BatchLayout(starts, [n - 1 for n in lengths], tables, len(lengths),
                         torch.tensor(slots), block_size)
    q = torch.randn(len(lengths), backend.spec.num_heads, backend.spec.head_dim,
                    generator=generator)
    return backend.build_metadata(layout), q


@pytest.mark.parametrize("in_place", [True, False])
def test_every_block_kept_is_dense_to_float32_rounding(tmp_path, in_place, monkeypatch):
    monkeypatch.setattr(BlockSparseAttention, "in_place", in_place)
    generator = torch.Generator().manual_seed(5)
    calibration = SparseCalibration(2, 2, 16, 4, [[0.1, 0.2], [0.3, 0.4]],
                                    [[[0, 3], [1, 2]]] * 2, {})
    calibration.save(tmp_path / "c.json")
    cache = KVCache.allocate(64, 8, 2, 16, torch.float32, torch.float32, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=generator))
    for name, sparse in [("retrieval-topp", SparseSettings(
            budget=4096, dense_layers=0, min_tokens=4096, retrieval_fraction=1.0,
            calibration=str(tmp_path / "c.json"), min_context=0)),
            ("quest", SparseSettings(budget=4096, dense_layers=0, min_context=0))]:
        backend = ATTENTION_BACKENDS[name](AttentionSpec(2, 4, 2, 16, 8, sparse))
        backend.allocate_state([cache, cache])
        keys = cache.data[0].flatten(0, 1)
        backend.observe_keys(1, keys, torch.arange(keys.shape[0]))
        metadata, q = batch_of_rows(backend, cache, [5, 37, 120], generator)
        dense = PagedAttention._decode(backend, q, cache, metadata, 0.25, 1)
        torch.testing.assert_close(backend._decode(q, cache, metadata, 0.25, 1), dense,
                                   rtol=1e-5, atol=1e-5)
        assert backend.active_tokens == 2 * (5 + 37 + 120)  # every key, both KV heads
