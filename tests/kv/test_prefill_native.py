"""The causal prefill kernel (csrc/prefill_causal.cpp: the paged-native backend's
prefill chunks, read from the paged cache) against torch's SDPA, the longest sequence it
takes as measured, and the backend taking it only where it applies."""

from __future__ import annotations

import pytest
import torch

import tokenmill.attention.paged_native as paged_native
import tokenmill.attention.prefill_native as prefill_native
import tokenmill.layers.product_table as product_table
from tokenmill import LLM, SamplingParams
from tokenmill.attention.paged import context_attention
from tokenmill.cli import main

kernel = prefill_native.native_prefill()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler for the kernel")


def paged_chunks(contexts, lengths, kv_heads, head_dim, block_size, generator):
    """Caches [blocks, block_size, KVH, D] holding each chunk's sequence (context and
    chunk) in shuffled blocks, the chunks' tables, and each sequence's K/V in order."""
    blocks_each = [-(-(c + n) // block_size) for c, n in zip(contexts, lengths, strict=True)]
    order = torch.randperm(sum(blocks_each) + 3, generator=generator)  # spare blocks too
    shape = (len(order), block_size, kv_heads, head_dim)
    key_cache, value_cache = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    tables, sequences, used = [], [], 0
    for count, context, n in zip(blocks_each, contexts, lengths, strict=True):
        table = order[used:used + count]
        used += count
        tables.append(table)
        sequences.append(tuple(cache[table].flatten(0, 1)[:context + n]
                               for cache in (key_cache, value_cache)))
    return key_cache, value_cache, tables, sequences


# Chunks of 1 token, within one block of 16 positions, across blocks, and longer than a
# block's padded rows, some behind a cached context; head sizes of one to eight vectors.
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [
    (14, 2, 64), (8, 8, 32), (4, 1, 16), (4, 2, 128), (6, 3, 48)])
# Blocks of 16 or 5 query positions; keys in one pass, or in passes of 48 or 7 keys
# (a running softmax across them); cache blocks of 16 or 5 tokens.
@pytest.mark.parametrize(("block_positions", "key_block", "block_size"),
                         [(16, 256, 16), (5, 48, 5), (16, 7, 16)])
def test_the_kernel_equals_sdpa_per_chunk(heads, kv_heads, head_dim, block_positions,
                                          key_block, block_size):
    if head_dim % kernel.lanes():
        pytest.skip(f"head_dim {head_dim} is not a multiple of {kernel.lanes()} lanes")
    generator = torch.Generator().manual_seed(heads + head_dim)
    lengths = [1, 5, 17, 40, 130, 3, 33]
    contexts = [0, 0, 0, 0, 0, 70, 150]
    lead = 3  # rows before the first chunk (decode rows in a mixed step): untouched
    starts = [lead + sum(lengths[:i]) for i in range(len(lengths))]
    rows = lead + sum(lengths)
    # Strided query rows, as the fused projection hands them over.
    q = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=generator)[:, :heads]
    key_cache, value_cache, tables, sequences = paged_chunks(
        contexts, lengths, kv_heads, head_dim, block_size, generator)
    out = torch.full((rows, heads, head_dim), float("nan"))
    width = max(len(t) for t in tables)
    padded = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables])
    kernel.causal_prefill(q, key_cache, value_cache, out, padded, torch.tensor(contexts),
                          torch.tensor(starts), torch.tensor(lengths), 0.3, block_positions,
                          key_block)
    assert out[:lead].isnan().all()
    for start, n, context, (keys, values) in zip(starts, lengths, contexts, sequences,
                                                 strict=True):
        want = context_attention(q[start:start + n].transpose(0, 1)[None],
                                 keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                 context, 0.3, split=False)[0].transpose(0, 1)
        torch.testing.assert_close(out[start:start + n], want, atol=1e-5, rtol=1e-5)


def test_bad_input_is_named():
    q, out = torch.randn(8, 4, 32), torch.empty(8, 4, 32)
    cache = torch.randn(4, 4, 2, 32)
    tables, one = torch.tensor([[0, 1, 2]]), torch.tensor([0])
    with pytest.raises(RuntimeError, match="outside the batch"):
        kernel.causal_prefill(q, cache, cache, out, tables, one, torch.tensor([4]),
                              torch.tensor([5]), 0.1, 16, 64)
    with pytest.raises(RuntimeError, match="block table is shorter"):
        kernel.causal_prefill(q, cache, cache, out, tables, torch.tensor([6]), one,
                              torch.tensor([8]), 0.1, 16, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.causal_prefill(q, cache, cache, out, torch.tensor([[0, 9]]), one, one,
                              torch.tensor([8]), 0.1, 16, 64)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernel.causal_prefill(q, torch.randn(4, 4, 3, 32), torch.randn(4, 4, 3, 32), out,
                              tables, one, one, torch.tensor([8]), 0.1, 16, 64)


def test_the_limit_is_the_longest_length_never_slower():
    assert prefill_native.choose_limit({128: (1, 2), 256: (2, 2), 512: (3, 2), 1024: (1, 2)}) == 256
    assert prefill_native.choose_limit({128: (3, 2), 256: (1, 2)}) == 0
    assert prefill_native.choose_limit({256: (1, 2), 128: (1, 2)}) == 256  # any order


def test_the_limit_is_measured_once_and_cached(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(prefill_native, "CACHE", tmp_path)
    monkeypatch.setattr(prefill_native, "MAX_PROBE", 256)
    timed = []
    real = prefill_native.time_chunk

    def counted(*args):
        timed.append(args[1])
        return real(*args)

    monkeypatch.setattr(prefill_native, "time_chunk", counted)
    first = prefill_native.longest_sequence(kernel, 4, 2, 32)
    # A throw-away round (the process's first calls), then each length.
    assert timed == [128, 128, 256] and first in (0, 128, 256)
    assert prefill_native.longest_sequence(kernel, 4, 2, 32) == first and timed == [128, 128, 256]
    prefill_native.longest_sequence(kernel, 4, 4, 32)  # another geometry: its own table
    assert timed == [128, 128, 256] * 2
    # `tokenmill tune --report` prints both tables and their choices.
    monkeypatch.setattr(product_table, "CACHE", tmp_path)  # no product table stored
    assert main(["tune", "--report", "--threads", str(torch.get_num_threads())]) == 0
    out = capsys.readouterr().out
    assert "4 query / 2 KV heads of 32" in out and "4 query / 4 KV heads of 32" in out
    assert out.count("| 128 |") == 2 and out.count("choice:") == 2


def test_the_backend_takes_the_kernel_for_sequences_up_to_the_limit(monkeypatch, llama_dir):
    """A step's chunks in one call, those behind a cached context (chunked prefill)
    too; a sequence over the measured limit, a quantized cache, and a sparse backend's
    chunks behind a context take their other paths; greedy tokens equal `paged`'s
    everywhere."""
    calls = []

    class Spy:
        lanes = staticmethod(kernel.lanes)

        @staticmethod
        def causal_prefill(*args):
            calls.append((args[5].tolist(), args[7].tolist()))  # contexts, lengths
            return kernel.causal_prefill(*args)

    monkeypatch.setattr(paged_native, "native_prefill", lambda: Spy)
    limit = [1024]
    monkeypatch.setattr(prefill_native, "longest_sequence", lambda *args: limit[0])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 17, 42, 99, 3], list(range(20, 61))]
    plain = LLM(str(llama_dir), progress=False, attention_backend="paged")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    native = LLM(str(llama_dir), progress=False, attention_backend="paged-native")
    assert [o.outputs[0].token_ids for o in native.generate(prompts, params)] == expected
    layers = native.engine.executor.worker.runner.arch.num_layers
    assert calls == [([0, 0], [5, 41])] * layers
    calls.clear()
    chunks = {"max_num_batched_tokens": 16, "enable_chunked_prefill": True}
    chunked = LLM(str(llama_dir), progress=False, attention_backend="paged-native", **chunks)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == expected
    assert all(n <= 16 for _, lengths in calls for n in lengths)
    assert any(context > 0 for contexts, _ in calls for context in contexts)
    calls.clear()
    limit[0] = 8
    short = LLM(str(llama_dir), progress=False, attention_backend="paged-native")
    assert [o.outputs[0].token_ids for o in short.generate(prompts, params)] == expected
    assert calls and all(call == ([0], [5]) for call in calls)
    calls.clear()
    limit[0] = 1024
    quantized = LLM(str(llama_dir), progress=False, attention_backend="paged-native",
                    kv_cache_dtype="int8")
    quantized.generate(prompts, params)
    assert calls == []
    sparse = LLM(str(llama_dir), progress=False, attention_backend="quest", **chunks)
    sparse.generate(prompts, params)
    assert calls and all(contexts == [0] * len(contexts) for contexts, _ in calls)
