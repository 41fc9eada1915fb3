"""The causal prefill kernel (csrc/prefill_causal.cpp, the paged-native backend's
fresh prefill chunks) against torch's SDPA, the longest chunk it takes as measured, and
the backend taking it only where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tokenmill.attention.fresh_prefill as fresh_prefill
import tokenmill.attention.paged_native as paged_native
import tokenmill.layers.product_table as product_table
from tokenmill import LLM, SamplingParams
from tokenmill.cli import main

kernel = fresh_prefill.native_prefill()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler for the kernel")


def reference(q, k, v, starts, lengths, scale):
    return [F.scaled_dot_product_attention(
        *(x[s:s + n].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, scale=scale,
        enable_gqa=True)[0].transpose(0, 1) for s, n in zip(starts, lengths, strict=True)]


# Chunks of 1 token, within one block of 16 positions, across blocks, and longer than a
# block's padded rows; head sizes of one to eight vectors.
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [
    (14, 2, 64), (8, 8, 32), (4, 1, 16), (4, 2, 128), (6, 3, 48)])
# Blocks of 16 or 5 query positions; keys in one pass, or in passes of 48 or 7 keys
# (a running softmax across them).
@pytest.mark.parametrize(("block_positions", "key_block"), [(16, 256), (5, 48), (16, 7)])
def test_the_kernel_equals_sdpa_per_chunk(heads, kv_heads, head_dim, block_positions,
                                          key_block):
    if head_dim % kernel.lanes():
        pytest.skip(f"head_dim {head_dim} is not a multiple of {kernel.lanes()} lanes")
    generator = torch.Generator().manual_seed(heads + head_dim)
    lengths = [1, 5, 17, 40, 130]
    lead = 3  # rows before the first chunk (decode rows in a mixed step): untouched
    starts = [lead + sum(lengths[:i]) for i in range(len(lengths))]
    rows = lead + sum(lengths)
    # Strided rows of one fused projection, as the model hands them over.
    fused = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=generator)
    q, k, v = fused.split((heads, kv_heads, kv_heads), dim=1)
    out = torch.full((rows, heads, head_dim), float("nan"))
    kernel.causal_prefill(q, k, v, out, torch.tensor(starts), torch.tensor(lengths), 0.3,
                          block_positions, key_block)
    assert out[:lead].isnan().all()
    expected = reference(q, k, v, starts, lengths, 0.3)
    for start, n, want in zip(starts, lengths, expected, strict=True):
        torch.testing.assert_close(out[start:start + n], want, atol=1e-5, rtol=1e-5)


def test_bad_input_is_named():
    q, k, v = torch.randn(8, 4, 32), torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    out = torch.empty(8, 4, 32)
    with pytest.raises(RuntimeError, match="outside the batch"):
        kernel.causal_prefill(q, k, v, out, torch.tensor([4]), torch.tensor([5]), 0.1, 16, 64)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernel.causal_prefill(q, torch.randn(8, 3, 32), torch.randn(8, 3, 32), out,
                              torch.tensor([0]), torch.tensor([8]), 0.1, 16, 64)


def test_the_limit_is_the_longest_length_never_slower():
    assert fresh_prefill.choose_limit({128: (1, 2), 256: (2, 2), 512: (3, 2), 1024: (1, 2)}) == 256
    assert fresh_prefill.choose_limit({128: (3, 2), 256: (1, 2)}) == 0
    assert fresh_prefill.choose_limit({256: (1, 2), 128: (1, 2)}) == 256  # any order


def test_the_limit_is_measured_once_and_cached(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(fresh_prefill, "CACHE", tmp_path)
    monkeypatch.setattr(fresh_prefill, "MAX_PROBE", 256)
    timed = []
    real = fresh_prefill.time_chunk

    def counted(*args):
        timed.append(args[1])
        return real(*args)

    monkeypatch.setattr(fresh_prefill, "time_chunk", counted)
    first = fresh_prefill.longest_chunk(kernel, 4, 2, 32)
    # A throw-away round (the process's first calls), then each length.
    assert timed == [128, 128, 256] and first in (0, 128, 256)
    assert fresh_prefill.longest_chunk(kernel, 4, 2, 32) == first and timed == [128, 128, 256]
    fresh_prefill.longest_chunk(kernel, 4, 4, 32)  # another geometry: its own table
    assert timed == [128, 128, 256] * 2
    # `tokenmill tune --report` prints both tables and their choices.
    monkeypatch.setattr(product_table, "CACHE", tmp_path)  # no product table stored
    assert main(["tune", "--report", "--threads", str(torch.get_num_threads())]) == 0
    out = capsys.readouterr().out
    assert "4 query / 2 KV heads of 32" in out and "4 query / 4 KV heads of 32" in out
    assert out.count("| 128 |") == 2 and out.count("choice:") == 2


def test_the_backend_takes_the_kernel_for_fresh_chunks_only(monkeypatch, llama_dir):
    """Fresh chunks (no cached context) of a step in one call; a chunk with a context
    (chunked prefill), a chunk over the measured limit and a quantized cache take the
    `paged` path; greedy tokens equal that path's everywhere."""
    calls = []

    class Spy:
        lanes = staticmethod(kernel.lanes)

        @staticmethod
        def causal_prefill(*args):
            calls.append(args[5].tolist())
            return kernel.causal_prefill(*args)

    monkeypatch.setattr(paged_native, "native_prefill", lambda: Spy)
    limit = [1024]
    monkeypatch.setattr(fresh_prefill, "longest_chunk", lambda *args: limit[0])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 17, 42, 99, 3], list(range(20, 61))]
    plain = LLM(str(llama_dir), progress=False, attention_backend="paged")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    native = LLM(str(llama_dir), progress=False, attention_backend="paged-native")
    assert [o.outputs[0].token_ids for o in native.generate(prompts, params)] == expected
    assert calls == [[5, 41]] * native.engine.executor.worker.runner.arch.num_layers
    calls.clear()
    chunked = LLM(str(llama_dir), progress=False, attention_backend="paged-native",
                  max_num_batched_tokens=16, enable_chunked_prefill=True)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == expected
    assert calls and all(length <= 16 for lengths in calls for length in lengths)
    calls.clear()
    limit[0] = 8
    short = LLM(str(llama_dir), progress=False, attention_backend="paged-native")
    assert [o.outputs[0].token_ids for o in short.generate(prompts, params)] == expected
    assert calls and all(lengths == [5] for lengths in calls)
    calls.clear()
    quantized = LLM(str(llama_dir), progress=False, attention_backend="paged-native",
                    kv_cache_dtype="int8")
    quantized.generate(prompts, params)
    assert calls == []
