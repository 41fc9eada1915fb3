"""quest's and static-topk's native decode path (attention/csrc/topk_select.cpp, then
the list attention of block_sparse_decode.cpp): its block choice is the PyTorch
selection's (attention/quest.py, the reference) on scattered blocks, mixed lengths and
budgets from two blocks to more than a row has, and its output and counters are the
gathered route's."""

from __future__ import annotations

import pytest
import torch

from tests.kv.test_block_sparse_native import LENGTHS, lists_to_mask
from tests.kv.test_retrieval_topp import batch_of_rows
from tokenmill.attention.base import AttentionSpec, SparseSettings
from tokenmill.attention.block_sparse import BlockSparseAttention
from tokenmill.attention.quest import native_topk_select
from tokenmill.attention.registry import ATTENTION_BACKENDS
from tokenmill.kv import KVCache

BACKENDS = ["quest", "static-topk"]


@pytest.fixture(scope="module")
def kernel():
    module = native_topk_select()
    if module is None:
        pytest.skip("the native kernel could not be built here")
    return module


def backend_over(name: str, cache: KVCache, budget: int, native: bool = True):
    """A backend of every layer sparse, its key bounds observed from the whole pool."""
    sparse = SparseSettings(budget=budget, dense_layers=0, min_context=0)
    backend = ATTENTION_BACKENDS[name](AttentionSpec(2, 8, 4, 16, 8, sparse))
    backend.native = native
    backend.allocate_state([cache, cache])
    keys = cache.data[0].flatten(0, 1)
    backend.observe_keys(1, keys, torch.arange(keys.shape[0]))
    return backend


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("budget", [8, 24, 64, 200, 4096])
def test_the_native_choice_is_the_pytorch_one(kernel, name, budget):
    generator = torch.Generator().manual_seed(budget)
    cache = KVCache.allocate(256, 8, 4, 16, torch.float32, torch.float32, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=generator))
    backend = backend_over(name, cache, budget)
    assert backend.select_kernel is kernel and backend.crossover_tag.startswith("native-")
    metadata, q = batch_of_rows(backend, cache, LENGTHS, generator)
    tables, lengths = metadata.decode_block_tables, metadata.decode_lengths
    grouped = q.view(len(LENGTHS), 4, 2, 16)
    expected = backend.select_blocks(1, grouped, tables, lengths, cache)
    lists, counts = kernel.topk_select(grouped.contiguous(), backend.key_min[1],
                                       backend.key_max[1], cache.data[0], tables, lengths,
                                       max(1, budget // 8), name == "static-topk")
    assert torch.equal(lists_to_mask(lists, counts, tables.shape[1]), expected)
    blocks = [(n + 7) // 8 for n in LENGTHS]
    assert counts.tolist() == [[min(n, max(2, budget // 8))] * 4 for n in blocks]


@pytest.mark.parametrize("name", BACKENDS)
def test_native_decode_is_the_gathered_route(kernel, name, monkeypatch):
    generator = torch.Generator().manual_seed(21)
    cache = KVCache.allocate(256, 8, 4, 16, torch.float32, torch.float32, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=generator))
    outputs, counters = [], []
    for native in (True, False):
        monkeypatch.setattr(BlockSparseAttention, "in_place", native)
        backend = backend_over(name, cache, 40, native)
        assert (backend.kernel is not None) == native
        metadata, q = batch_of_rows(backend, cache, LENGTHS, torch.Generator().manual_seed(4))
        outputs.append(backend._decode(q, cache, metadata, 0.25, 1))
        counters.append((backend.active_tokens, backend.queries, dict(backend.kind_counts)))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    assert counters[0] == counters[1]
    assert counters[0][0] < sum(LENGTHS) * 4  # sparse: not every key


def test_a_quantized_cache_keeps_the_pytorch_route():
    cache = KVCache.allocate(16, 8, 4, 16, torch.int8, torch.float32, torch.device("cpu"))
    backend = ATTENTION_BACKENDS["quest"](AttentionSpec(2, 8, 4, 16, 8, SparseSettings()))
    backend.allocate_state([cache, cache])
    assert backend.kernel is None and backend.crossover_tag == "torch"


def test_the_self_checks_cache_follows_the_kernels_text(tmp_path, kernel):
    cache = KVCache.allocate(16, 8, 4, 16, torch.float32, torch.float32, torch.device("cpu"))
    backend = backend_over("quest", cache, 64)
    tag = backend.crossover_tag
    assert tag.startswith("native-") and tag == backend_over("quest", cache, 64).crossover_tag
    source = tmp_path / "kernel.cpp"
    source.write_text("// one kernel\n")
    backend.native_sources = (*backend.native_sources, source)
    before = backend.crossover_tag
    source.write_text("// the kernel, changed\n")
    assert before != tag and backend.crossover_tag != before
