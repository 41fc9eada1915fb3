"""The in-place paged decode kernel (`--attention-backend paged-native`) against the
gather-and-SDPA reference, and the backend taking it only where it applies."""

from __future__ import annotations

import pytest
import torch

import tokenmill.attention.paged_native as paged_native
from tokenmill import LLM, SamplingParams
from tokenmill.attention.paged import grouped_decode_attention

kernel = paged_native.native_decode()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler for the kernel")


# Head sizes 16-128 take the AVX-512 register form where the CPU has it (32-128 the
# 8-lane form under AVX2: tests/test_isa.py runs this so), 24 the plain loops; blocks
# under 16 tokens make a tile span blocks, blocks over 16 hold two tiles.
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [
    (14, 2, 64, 16), (8, 8, 32, 4), (4, 1, 16, 1), (6, 2, 24, 8), (4, 2, 128, 32)])
# A lone long request is split into shares across threads, merged at the end.
@pytest.mark.parametrize("contexts", [(1, 7, 80, 83), (40 * 16 + 5,)])
def test_the_kernel_equals_gathered_attention(heads, kv_heads, head_dim, block_size, contexts):
    generator = torch.Generator().manual_seed(0)
    blocks = 1024
    keys = torch.randn(blocks, block_size, kv_heads, head_dim, generator=generator)
    values = torch.randn(blocks, block_size, kv_heads, head_dim, generator=generator)
    lengths = torch.tensor(contexts)
    width = -(-max(contexts) // block_size)
    tables = torch.stack([torch.randperm(blocks, generator=generator)[:width] for _ in lengths])
    q = torch.randn(len(lengths), heads, head_dim, generator=generator)
    out = kernel.paged_decode(q, keys, values, tables, lengths, 0.3)
    flat = tables.reshape(-1)
    gathered_k = keys.index_select(0, flat).reshape(len(lengths), -1, kv_heads, head_dim)
    gathered_v = values.index_select(0, flat).reshape(len(lengths), -1, kv_heads, head_dim)
    positions = torch.arange(gathered_k.shape[1])
    mask = (positions[None, :] < lengths[:, None])[:, None, None, :]
    reference = grouped_decode_attention(q, gathered_k, gathered_v, mask, 1, 0.3)
    torch.testing.assert_close(out, reference, atol=2e-6, rtol=1e-5)


class KernelLevels:
    """The kernel's prefetch-level calls, which the backend makes at start-up
    (attention/kv_fetch.py), for the spies below (None where the tests are skipped)."""

    fetch_level = staticmethod(getattr(kernel, "fetch_level", None))
    set_fetch_level = staticmethod(getattr(kernel, "set_fetch_level", None))
    built_fetch_level = staticmethod(getattr(kernel, "built_fetch_level", None))


def test_the_backend_takes_the_kernel_for_one_token_rows_only(monkeypatch, llama_dir):
    calls, whole = [], []
    real = kernel.paged_decode

    class Spy(KernelLevels):
        @staticmethod
        def paged_decode(*args):
            calls.append(args[0].shape[0])
            return real(*args)

        @staticmethod
        def write_and_decode(*args):  # a decode-only step: K/V written in the same call
            calls.append(args[0].shape[0])
            return kernel.write_and_decode(*args)

        @staticmethod
        def rope_write_and_decode(*args):  # ... taken whole from the qkv projection
            calls.append(args[0].shape[0])
            whole.append(args[0].shape[0])
            return kernel.rope_write_and_decode(*args)

    monkeypatch.setattr(paged_native, "native_decode", lambda: Spy)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 17, 42, 99, 3], list(range(20, 61))]
    native = LLM(str(llama_dir), progress=False, attention_backend="paged-native")
    plain = LLM(str(llama_dir), progress=False, attention_backend="paged")
    assert ([o.outputs[0].token_ids for o in native.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params)])
    assert calls and max(calls) == 2  # both requests' decode rows, in place
    assert whole and max(whole) == 2  # decode-only steps whole from each layer's qkv
    calls.clear()
    quantized = LLM(str(llama_dir), progress=False, attention_backend="paged-native",
                    kv_cache_dtype="int8")
    quantized.generate(prompts, params)
    assert calls == []  # a quantized cache is dequantized by the gather path


def test_metadata_without_a_mask_still_serves_the_gather_path(monkeypatch, llama_dir):
    """With the kernel ready the backend builds no decode mask (it reads key counts);
    should a step's rows still take the gather path, the mask is made from the counts."""
    native = LLM(str(llama_dir), progress=False, attention_backend="paged-native")
    backend = native.engine.executor.worker.runner.backend
    built = []
    real_build = backend.build_metadata

    def build(layout):
        built.append(real_build(layout))
        return built[-1]

    monkeypatch.setattr(backend, "build_metadata", build)
    monkeypatch.setattr(backend, "_kernel", lambda *args: None)  # every row: the gather
    monkeypatch.setattr(backend, "takes_whole_decode", lambda metadata: False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 17, 42, 99, 3], list(range(20, 61))]
    plain = LLM(str(llama_dir), progress=False, attention_backend="paged")
    assert ([o.outputs[0].token_ids for o in native.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params)])
    decodes = [m for m in built if m.num_decode_tokens and not m.prefills]
    assert decodes and all(m.decode_mask is None for m in decodes)


def test_write_and_decode_stores_the_rows_then_attends():
    generator = torch.Generator().manual_seed(1)
    blocks, block_size, kv_heads, head_dim, heads = 64, 16, 2, 64, 14
    keys = torch.randn(blocks, block_size, kv_heads, head_dim, generator=generator)
    values = torch.randn(blocks, block_size, kv_heads, head_dim, generator=generator)
    expected_k, expected_v = keys.clone(), values.clone()
    # Two rows: contexts of 20 and 37 tokens, each one's new token at its last slot.
    tables = torch.tensor([[5, 9, 0], [3, 40, 12]])
    lengths = torch.tensor([21, 38])
    slots = torch.tensor([9 * block_size + 4, 12 * block_size + 5])
    # K and V as the model hands them over: strided rows of one fused projection.
    fused = torch.randn(2, heads + 2 * kv_heads, head_dim, generator=generator)
    q, k, v = fused.split((heads, kv_heads, kv_heads), dim=1)
    for row, slot in enumerate(slots.tolist()):
        expected_k[slot // block_size, slot % block_size] = k[row]
        expected_v[slot // block_size, slot % block_size] = v[row]
    out = kernel.write_and_decode(q, k, v, slots, keys, values, tables, lengths, 0.125)
    assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)
    assert torch.equal(out, kernel.paged_decode(q, keys, values, tables, lengths, 0.125))
    with pytest.raises(RuntimeError, match="one block table and one key count per query"):
        kernel.paged_decode(q, keys, values, tables[:1], lengths[:1], 0.125)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernel.write_and_decode(q, k, v, slots + blocks * block_size, keys, values, tables,
                                lengths, 0.125)


def test_speculative_rows_take_the_kernel_token_by_token(monkeypatch, llama_dir):
    """A speculative row's tokens (the last real one plus the proposals) are rows of
    their own for the kernel, each seeing its context and its row's tokens up to it:
    greedy output equals the gather path's, with and without speculation."""
    calls = []

    class Spy(KernelLevels):
        @staticmethod
        def paged_decode(*args):
            calls.append((args[0].shape[0], args[3].shape[0]))
            return kernel.paged_decode(*args)

        @staticmethod
        def write_and_decode(*args):
            calls.append((args[0].shape[0], args[6].shape[0]))
            return kernel.write_and_decode(*args)

        @staticmethod
        def rope_write_and_decode(*args):
            calls.append((args[0].shape[0], args[6].shape[0]))
            return kernel.rope_write_and_decode(*args)

    monkeypatch.setattr(paged_native, "native_decode", lambda: Spy)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # Repetitive prompts, so n-gram lookup proposes tokens every step.
    prompts = [[5, 17, 42, 99, 3] * 6, list(range(20, 41)) * 2]
    spec = {"speculative_method": "ngram", "prompt_lookup_min": 1, "spec_adaptive": False}
    native = LLM(str(llama_dir), progress=False, attention_backend="paged-native", **spec)
    gathered = LLM(str(llama_dir), progress=False, attention_backend="paged", **spec)
    plain = LLM(str(llama_dir), progress=False, attention_backend="paged")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in gathered.generate(prompts, params)] == expected
    assert [o.outputs[0].token_ids for o in native.generate(prompts, params)] == expected
    # Some step ran more query tokens than requests through the kernel, one table each.
    assert any(tokens > 2 and tables == tokens for tokens, tables in calls)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "rows"), [
    (14, 2, 64, 1), (14, 2, 64, 5), (8, 8, 32, 3), (4, 1, 16, 2)])
def test_rope_write_and_decode_equals_the_layer_s_own_steps(heads, kv_heads, head_dim, rows):
    """A decode step taken whole from the qkv projection: the same bits as the layer's
    split, in-place rotation (row_ops) and write_and_decode, the pool included."""
    from tokenmill.layers.rotary import rotate

    generator = torch.Generator().manual_seed(2)
    blocks, block_size = 64, 16
    keys = torch.randn(blocks, block_size, kv_heads, head_dim, generator=generator)
    values = torch.randn(blocks, block_size, kv_heads, head_dim, generator=generator)
    tables = torch.stack([torch.randperm(blocks, generator=generator)[:4] for _ in range(rows)])
    lengths = torch.randint(1, 4 * block_size + 1, (rows,), generator=generator)
    slots = torch.stack([tables[r, (lengths[r] - 1) // block_size] * block_size
                         + (lengths[r] - 1) % block_size for r in range(rows)])
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator)
    angles = torch.rand(rows, 1, head_dim // 2, generator=generator) * 100
    rope = (angles.cos(), angles.sin())  # as RotaryEmbedding hands them: [T, 1, D / 2]

    expected_qkv, expected_k, expected_v = qkv.clone(), keys.clone(), values.clone()
    qk = expected_qkv[:, :(heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
    with torch.inference_mode():  # the compiled rotation, in place (row_ops.rotate_)
        q, k = rotate(qk, rope).split((heads, kv_heads), dim=1)
    v = expected_qkv[:, (heads + kv_heads) * head_dim:].view(rows, kv_heads, head_dim)
    expected = kernel.write_and_decode(q, k, v, slots, expected_k, expected_v, tables, lengths,
                                       0.125)
    out = kernel.rope_write_and_decode(qkv, *rope, slots, keys, values, tables, lengths, 0.125,
                                       heads)
    assert torch.equal(out, expected.reshape(rows, heads * head_dim))
    assert torch.equal(qkv, expected_qkv)  # rotated in place, as rotate_ does
    assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)
    with pytest.raises(RuntimeError, match="columns"):
        kernel.rope_write_and_decode(qkv, *rope, slots, keys, values, tables, lengths, 0.125,
                                     heads + 1)
    with pytest.raises(RuntimeError, match="cos and sin"):
        kernel.rope_write_and_decode(qkv, rope[0][:, :, 1:], rope[1], slots, keys, values,
                                     tables, lengths, 0.125, heads)
