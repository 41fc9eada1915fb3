"""Sparse prefill (`--sparse-prefill`): a chunk on a long context attends to exactly
the context blocks its backend's decode rule keeps for its probe queries (per KV
head) and to itself causally; with every block kept it is dense prefill token for
token; it composes with chunked prefill, prefix caching and an int8 cache."""

from __future__ import annotations

import pytest
import torch

from tests.engine_run import run_staggered
from tests.kv.test_retrieval_topp import calibrated  # noqa: F401 (a fixture)
from tokenmill import SamplingParams
from tokenmill.attention import sparse_prefill
from tokenmill.attention.base import AttentionSpec, SparseSettings
from tokenmill.attention.paged import PrefillChunk
from tokenmill.attention.registry import ATTENTION_BACKENDS
from tokenmill.attention.sparse_calibration import SparseCalibration
from tokenmill.engine.engine import LLMEngine
from tokenmill.kv import KVCache

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(3, 150)), [5, 17, 42] * 40, list(range(100, 131))]


def reference(q, keys, values, kept, context, seq_len, block_size, group, scale):
    """Per query head, softmax attention over the kept context tokens and the chunk's
    tokens up to the query, by plain masking of the whole sequence."""
    n, heads, _ = q.shape
    out = torch.empty_like(q)
    for h in range(heads):
        kv = h // group
        for i in range(n):
            position = context + i
            allowed = [j for j in range(seq_len)
                       if (j < context and kept[kv, j // block_size]) or context <= j <= position]
            scores = (keys[allowed, kv] @ q[i, h]) * scale
            out[i, h] = scores.softmax(-1) @ values[allowed, kv]
    return out


@pytest.mark.parametrize("name", ["retrieval-topp", "quest", "static-topk"])
def test_a_chunk_attends_to_exactly_the_kept_blocks_and_itself(tmp_path, name):
    generator = torch.Generator().manual_seed(7)
    calibration = SparseCalibration(2, 2, 16, 4, [[0.1, 0.2], [0.3, 0.4]],
                                    [[[0, 3], [1, 2]]] * 2, {})
    calibration.save(tmp_path / "c.json")
    block_size, blocks = 8, 40
    cache = KVCache.allocate(blocks, block_size, 2, 16, torch.float32, torch.float32,
                             torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=generator))
    sparse = SparseSettings(budget=32, dense_layers=0, top_p=0.5, min_tokens=8,
                            sink_tokens=8, window=16, retrieval_fraction=0.5,
                            calibration=str(tmp_path / "c.json"), min_context=0, prefill=True)
    backend = ATTENTION_BACKENDS[name](AttentionSpec(2, 4, 2, 16, block_size, sparse))
    backend.allocate_state([cache, cache])
    table = torch.randperm(blocks, generator=generator)[:30]
    context, n = 181, 36  # the chunk starts inside a block
    keys = cache.data[0][table].flatten(0, 1)  # [slots of the sequence, KVH, Dh]
    values = cache.data[1][table].flatten(0, 1)
    slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()
    backend.observe_keys(1, keys, slots)
    chunk = PrefillChunk(0, n, context, table[:-(-(context + n) // block_size)])
    assert sparse_prefill.worth_it(chunk, backend.least_kept())
    q = torch.randn(n, 4, 16, generator=generator)
    out = sparse_prefill.chunk_attention(backend, 1, q, chunk, cache, 0.25)
    probes = sparse_prefill.probe_rows(chunk)
    assert probes[-1] == n - 1 and len(probes) == sparse_prefill.PROBE_QUERIES
    context_blocks = -(-context // block_size)
    kept = backend.select_blocks(
        1, q[probes].view(len(probes), 2, 2, 16), chunk.block_table[:context_blocks][None]
        .expand(len(probes), -1).contiguous(), torch.full((len(probes),), context), cache
    ).any(0)
    assert 0 < kept.sum() < 2 * context_blocks  # sparse: some blocks left out
    expected = reference(q, keys, values, kept, context, context + n, block_size, 2, 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert backend.prefill_counts[1] == n * 2


def run(model_dir, **options):
    engine = LLMEngine.from_kwargs(str(model_dir), progress=False, block_size=4,
                                   max_num_batched_tokens=32, **options)
    return run_staggered(engine, PROMPTS, GREEDY, arrivals=[0, 0, 3]), engine


def test_every_block_kept_is_dense_prefill(calibrated, monkeypatch):  # noqa: F811
    model_dir, path = calibrated
    dense, _ = run(model_dir, attention_backend="paged")
    monkeypatch.setattr(sparse_prefill, "worth_it", lambda chunk, least: True)
    monkeypatch.setattr("tokenmill.attention.block_sparse.worth_it",
                        lambda chunk, least: True)
    tokens, engine = run(model_dir, attention_backend="retrieval-topp", sparse_calibration=path,
                         sparse_dense_layers=0, sparse_retrieval_fraction=1.0,
                         sparse_min_tokens=512, sparse_budget=512, sparse_prefill=True)
    assert tokens == dense
    assert engine.executor.worker.runner.backend.prefill_counts[1] > 0


def test_sparse_prefill_composes(calibrated):  # noqa: F811
    model_dir, path = calibrated
    for kv in ("auto", "int8"):
        tokens, engine = run(model_dir, attention_backend="retrieval-topp",
                             sparse_calibration=path, sparse_dense_layers=1,
                             sparse_sink_tokens=4, sparse_window=8, sparse_min_tokens=8,
                             sparse_budget=16, sparse_top_p=0.5, sparse_prefill=True,
                             kv_cache_dtype=kv, enable_prefix_caching=True, num_blocks=64)
        keys, queries = engine.executor.worker.runner.backend.prefill_counts
        assert queries > 0 and keys / queries < 100  # sparse: contexts reach 150 + 8
        assert all(len(t) == GREEDY.max_tokens for t in tokens)


def test_attention_in_two_parts_merges_to_attention_over_both():
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 9, 16, generator=generator)
    keys, values = torch.randn(2, 1, 4, 30, 16, generator=generator)
    own_keys, own_values = torch.randn(2, 1, 4, 9, 16, generator=generator)
    allowed = torch.cat([torch.ones(9, 30, dtype=torch.bool),
                         torch.ones(9, 9, dtype=torch.bool).tril()], dim=1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([keys, own_keys], 2), torch.cat([values, own_values], 2),
        attn_mask=allowed, scale=0.3)
    for dtype in (torch.float32, torch.float64):  # the fused CPU kernel, plain products
        cast = [t.to(dtype) for t in (q, keys, values, own_keys, own_values)]
        out = sparse_prefill.merge(
            sparse_prefill.attend(cast[0], cast[1], cast[2], 0.3, causal=False),
            sparse_prefill.attend(cast[0], cast[3], cast[4], 0.3, causal=True))
        torch.testing.assert_close(out.float(), expected, rtol=1e-5, atol=1e-5)
