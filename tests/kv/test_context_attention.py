"""A prefill chunk's attention over its cached context and itself: the split form
(two fused-kernel calls merged by log-sum-exp) against one masked SDPA call, and the
engine taking the split for chunks with a context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tokenmill.attention.paged as paged
from tokenmill import LLM, SamplingParams
from tokenmill.attention.paged import context_attention


@pytest.mark.parametrize(("heads", "kv_heads"), [(14, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize(("context", "n"), [(0, 9), (1, 1), (37, 5), (300, 64)])
def test_split_equals_one_masked_call(heads, kv_heads, context, n):
    generator = torch.Generator().manual_seed(context + n)
    q = torch.randn(1, heads, n, 32, generator=generator)
    # Keys and values strided as the cache's gather gives them ([L, KVH, Dh] viewed
    # as [1, KVH, L, Dh]).
    keys, values = (torch.randn(context + n, kv_heads, 32, generator=generator)
                    .transpose(0, 1)[None] for _ in range(2))
    split = context_attention(q, keys, values, context, 0.2, split=True)
    # The reference: every query's allowed keys spelled out, one softmax per query.
    positions = torch.arange(context + n)
    mask = positions[None, :] <= (context + torch.arange(n))[:, None]
    reference = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=0.2,
                                               enable_gqa=True)
    torch.testing.assert_close(split, reference, atol=1e-6, rtol=1e-5)
    masked = context_attention(q, keys, values, context, 0.2, split=False)
    torch.testing.assert_close(masked, reference, atol=1e-6, rtol=1e-5)


def test_chunked_prefill_takes_the_split_and_keeps_greedy_tokens(monkeypatch, llama_dir):
    """A prompt prefilled in chunks of 8 tokens (every chunk after the first has a
    context) gives the tokens of one whole-prompt prefill, through the split form."""
    calls = []
    real = paged.context_attention

    def counted(q, keys, values, context, scale, split=None):
        calls.append((context, split if split is not None else paged.fused_cpu_kernel(q)))
        return real(q, keys, values, context, scale, split)

    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # The `paged` backend's path (paged-native takes such chunks through its own kernel
    # up to a measured length: tests/kv/test_prefill_native.py).
    whole = LLM(llama_dir, progress=False, attention_backend="paged").generate(
        [prompt], params)[0].outputs[0].token_ids
    monkeypatch.setattr(paged, "context_attention", counted)
    chunked = LLM(llama_dir, progress=False, attention_backend="paged",
                  max_num_batched_tokens=8, enable_chunked_prefill=True).generate([prompt], params)
    assert chunked[0].outputs[0].token_ids == whole
    assert calls and all(split for _, split in calls)
    assert {context for context, _ in calls} >= {8, 16, 24, 32}
