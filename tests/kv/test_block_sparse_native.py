"""retrieval-topp's native decode path (attention/csrc/block_sparse_decode.cpp): its
block choice is the PyTorch selection's (attention/retrieval.py, the reference) on
scattered blocks, mixed lengths and every knob that shapes it, and its attention over
per-head block lists is the gathered route's over the same blocks."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kv.test_retrieval_topp import batch_of_rows
from tokenmill.attention.base import AttentionSpec, SparseSettings
from tokenmill.attention.block_sparse import BlockSparseAttention
from tokenmill.attention.registry import ATTENTION_BACKENDS
from tokenmill.attention.retrieval import native_block_sparse
from tokenmill.attention.sparse_calibration import SparseCalibration
from tokenmill.kv import KVCache

LENGTHS = [3, 40, 77, 130, 255, 256, 500]


def lists_to_mask(lists: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    mask = torch.zeros(*counts.shape, width, dtype=torch.bool)
    for row in range(counts.shape[0]):
        for head in range(counts.shape[1]):
            chosen = lists[row, head, :counts[row, head]]
            assert torch.equal(chosen, chosen.sort().values)  # context order
            mask[row, head, chosen] = True
    return mask


@pytest.fixture(scope="module")
def kernel():
    module = native_block_sparse()
    if module is None:
        pytest.skip("the native kernel could not be built here")
    return module


@pytest.mark.parametrize("top_p,least,most,fraction", [
    (0.9, 64, 2048, 0.5), (0.5, 8, 64, 1.0), (0.99, 0, 96, 0.5), (0.3, 128, 128, 1.0)])
def test_the_native_choice_is_the_pytorch_one(tmp_path, kernel, top_p, least, most,
                                              fraction):
    generator = torch.Generator().manual_seed(11)
    calibration = SparseCalibration(2, 4, 16, 8, [[0.1, 0.2, 0.5, 0.3]] * 2,
                                    [[[0, 3, 5, 6], [1, 2, 4, 7], [0, 1, 2, 3], [4, 5, 6, 7]]] * 2,
                                    {})
    calibration.save(tmp_path / "c.json")
    cache = KVCache.allocate(256, 8, 4, 16, torch.float32, torch.float32, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=generator))
    sparse = SparseSettings(budget=most, dense_layers=0, top_p=top_p, min_tokens=least,
                            sink_tokens=8, window=24, retrieval_fraction=fraction,
                            calibration=str(tmp_path / "c.json"), min_context=0)
    backend = ATTENTION_BACKENDS["retrieval-topp"](AttentionSpec(2, 8, 4, 16, 8, sparse))
    backend.allocate_state([cache, cache])
    assert backend.kernel is not None
    keys = cache.data[0].flatten(0, 1)
    backend.observe_keys(1, keys * 3.0, torch.arange(keys.shape[0]))  # peaked scores
    metadata, q = batch_of_rows(backend, cache, LENGTHS, generator)
    tables, lengths = metadata.decode_block_tables, metadata.decode_lengths
    grouped = (q * 3.0).view(len(LENGTHS), 4, 2, 16)
    expected = backend.select_blocks(1, grouped, tables, lengths, cache)
    lists, counts = kernel.topp_select(
        grouped.contiguous(), tables, lengths, backend.index[1], backend.index_dims[1],
        backend.retrieval_ids[1], 8, 1, 24, top_p, math.ceil(least / 8), max(1, most // 8),
        1 / math.sqrt(16))
    assert torch.equal(lists_to_mask(lists, counts, tables.shape[1]), expected)
    assert 0 < counts.sum() < expected.shape[-1] * len(LENGTHS) * 4 or least >= 128


def test_native_list_attention_is_the_gathered_route(tmp_path, kernel, monkeypatch):
    generator = torch.Generator().manual_seed(12)
    calibration = SparseCalibration(2, 2, 16, 4, [[0.1, 0.2], [0.3, 0.4]],
                                    [[[0, 3], [1, 2]]] * 2, {})
    calibration.save(tmp_path / "c.json")
    cache = KVCache.allocate(256, 8, 2, 16, torch.float32, torch.float32, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=generator))
    sparse = SparseSettings(budget=64, dense_layers=0, top_p=0.6, min_tokens=16,
                            sink_tokens=8, window=16, retrieval_fraction=0.5,
                            calibration=str(tmp_path / "c.json"), min_context=0)
    outputs, counters = [], []
    for native in (True, False):
        monkeypatch.setattr(BlockSparseAttention, "in_place", native)
        backend = ATTENTION_BACKENDS["retrieval-topp"](AttentionSpec(2, 4, 2, 16, 8, sparse))
        backend.allocate_state([cache, cache])
        assert (backend.kernel is not None) == native
        keys = cache.data[0].flatten(0, 1)
        backend.observe_keys(1, keys, torch.arange(keys.shape[0]))
        metadata, q = batch_of_rows(backend, cache, LENGTHS, torch.Generator().manual_seed(3))
        outputs.append(backend._decode(q, cache, metadata, 0.25, 1))
        counters.append(dict(backend.kind_counts))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    assert counters[0] == counters[1]
    assert counters[0]["retrieval"][0] < sum(LENGTHS)  # sparse: not every key


def test_the_self_check_times_each_count_of_retrieval_heads_apart(tmp_path):
    calibration = SparseCalibration(3, 2, 16, 4, [[0.9, 0.8], [0.1, 0.2], [0.3, 0.4]],
                                    [[[0, 3], [1, 2]]] * 3, {})
    calibration.save(tmp_path / "c.json")
    cache = KVCache.allocate(8, 8, 2, 16, torch.float32, torch.float32, torch.device("cpu"))
    sparse = SparseSettings(dense_layers=1, retrieval_fraction=0.5, min_context=0,
                            calibration=str(tmp_path / "c.json"))
    backend = ATTENTION_BACKENDS["retrieval-topp"](AttentionSpec(3, 4, 2, 16, 8, sparse))
    backend.allocate_state([cache] * 3)
    assert backend.retrieval == [[], [], [0, 1]]
    assert backend.probe_classes(3) == {"0-retrieval": [1], "2-retrieval": [2]}
    quest = ATTENTION_BACKENDS["quest"](AttentionSpec(3, 4, 2, 16, 8, sparse))
    assert quest.probe_classes(3) == {"": [1, 2]}


def test_each_group_of_layers_gets_its_own_crossover(tmp_path, monkeypatch):
    from tokenmill.attention import crossover

    monkeypatch.setenv("TOKENMILL_AUTO_TUNE", "1")
    monkeypatch.setattr(crossover, "CACHE", tmp_path / "cache")
    timed = []

    def fake_table(backend, kv_cache, layer, dense, sparse):
        timed.append(layer)  # local-only layer 1: sparse wins from 512; layer 2 never
        return ({256: (1.0, 2.0), 512: (2.0, 1.0), 1024: (4.0, 1.0)} if layer == 1
                else {256: (1.0, 2.0), 512: (2.0, 3.0)})

    monkeypatch.setattr(crossover, "measure_table", fake_table)
    calibration = SparseCalibration(3, 2, 16, 4, [[0.9, 0.8], [0.1, 0.2], [0.3, 0.4]],
                                    [[[0, 3], [1, 2]]] * 3, {})
    calibration.save(tmp_path / "c.json")
    cache = KVCache.allocate(8, 8, 2, 16, torch.float32, torch.float32, torch.device("cpu"))
    sparse = SparseSettings(dense_layers=1, retrieval_fraction=0.5,
                            calibration=str(tmp_path / "c.json"))
    backend = ATTENTION_BACKENDS["retrieval-topp"](AttentionSpec(3, 4, 2, 16, 8, sparse))
    backend.allocate_state([cache] * 3)
    assert sorted(timed) == [1, 2]
    assert backend.layer_min_context[1:] == [512, crossover.NEVER]
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 2  # one table per group
