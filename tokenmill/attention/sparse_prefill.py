"""Sparse attention for prefill chunks on a long cached context (`--sparse-prefill`,
off by default; quest, static-topk and retrieval-topp alike).

A chunk of a long prompt (chunked prefill, or a prompt behind a long cached prefix)
attends to its whole cached context in every layer: at 8K of context a 2K chunk's
attention is most of a small model's prefill work. Here a chunk of a sparse layer
attends to the context blocks its backend's decode rule keeps for a few of the
chunk's own queries (PROBE_QUERIES evenly spaced ones, the last among them, each
treated as a decode query on the cached context; the union of their blocks per KV
head), and to the chunk itself causally (dense). One masked SDPA per chunk over the
union of the heads' kept blocks and the chunk, each head's mask its own; keys read
back from the cache (dequantised if quantized), as the dense path does.

It applies where the context is over twice what the selection keeps at least of a
long context (quest, static-topk: the budget; retrieval-topp: the floor, or the
sinks and the window if more); shorter contexts, the first `--sparse-dense-layers`
layers and every decode row are untouched by it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.paged import PrefillChunk
from tokenmill.kv import KVCache
from tokenmill.kv.quant import dequantize

PROBE_QUERIES = 8  # chunk queries whose decode-rule choices a chunk attends to


def worth_it(chunk: PrefillChunk, least: int) -> bool:
    """Whether a chunk's cached context is over twice the `least` tokens its backend
    keeps of a long context (below it, selecting saves little)."""
    return chunk.context_len > 2 * least


def probe_rows(chunk: PrefillChunk) -> torch.Tensor:
    """Offsets in the chunk of its probe queries: evenly spaced, the last included."""
    n = chunk.end - chunk.start
    count = min(PROBE_QUERIES, n)
    return torch.linspace(n - 1, 0, count).round().long().flip(0).unique()


def chunk_attention(backend, layer_index: int, q: torch.Tensor, chunk: PrefillChunk,
                    kv_cache: KVCache, scale: float) -> torch.Tensor:
    """The chunk's attention output [n, H, Dh] over its kept context and itself."""
    spec = backend.spec
    block_size, kv_heads = spec.block_size, spec.num_kv_heads
    group = spec.num_heads // kv_heads
    device = q.device
    context = chunk.context_len
    q_chunk = q[chunk.start:chunk.end]  # [n, H, Dh]
    n = q_chunk.shape[0]
    probes = probe_rows(chunk)
    context_blocks = -(-context // block_size)
    tables = chunk.block_table[:context_blocks][None].expand(len(probes), -1).contiguous()
    lengths = torch.full((len(probes),), context, dtype=torch.int64, device=device)
    grouped = q_chunk[probes].view(len(probes), kv_heads, group, -1).float()
    chosen = backend.select_blocks(layer_index, grouped, tables, lengths, kv_cache).any(0)
    kept = torch.zeros(kv_heads, len(chunk.block_table), dtype=torch.bool, device=device)
    kept[:, :chosen.shape[1]] = chosen  # [KVH, the chunk's blocks too]
    # Keys: the union over heads of the kept context blocks, then the chunk's blocks.
    first_chunk_block = context // block_size
    union = kept.any(0).nonzero().flatten()
    union = union[union < first_chunk_block]
    blocks = torch.cat([union, torch.arange(first_chunk_block, len(chunk.block_table),
                                            device=device)])
    physical = chunk.block_table[blocks]
    keys, values = kv_cache.data[0][physical], kv_cache.data[1][physical]
    if kv_cache.quantized:
        keys = dequantize(keys, kv_cache.scales[0][physical], kv_cache.compute_dtype)
        values = dequantize(values, kv_cache.scales[1][physical], kv_cache.compute_dtype)
    positions = (blocks[:, None] * block_size
                 + torch.arange(block_size, device=device)).flatten()  # [L]
    keys = keys.flatten(0, 1).transpose(0, 1)[None].to(q.dtype)  # [1, KVH, L, Dh]
    values = values.flatten(0, 1).transpose(0, 1)[None].to(q.dtype)
    query_pos = torch.arange(context, chunk.seq_len, device=device)
    in_context = (positions < context)[None, :] & kept[:, positions // block_size]  # [KVH, L]
    causal = ((positions[None, :] >= context)
              & (positions[None, :] <= query_pos[:, None]))  # [n, L]
    mask = in_context[:, None, :] | causal[None]  # [KVH, n, L]
    mask = mask.repeat_interleave(group, dim=0)[None]  # [1, H, n, L]
    counts = backend.prefill_counts
    counts[0] += int(in_context.sum()) * n + int(causal.sum()) * kv_heads
    counts[1] += n * kv_heads
    out = F.scaled_dot_product_attention(q_chunk.transpose(0, 1)[None], keys, values,
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
