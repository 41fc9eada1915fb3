"""Reference paged attention in plain PyTorch (CPU and CUDA).

Decode rows (one token, or one plus speculative tokens, per request) are gathered
through their block tables into one padded batch and run as a single masked SDPA
call; each prefill chunk runs causally against its cached
context plus itself. Reads go through `KVCache.gather`, which dequantises a
quantized cache right after the gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.base import AttentionBackend, AttentionMetadata
from tokenmill.kv import KVCache


class PagedAttention(AttentionBackend):
    name = "paged"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, metadata: AttentionMetadata, scale: float
                ) -> torch.Tensor:
        kv_cache.write(k, v, metadata.slot_mapping)
        out = torch.empty_like(q)
        num_decode = metadata.num_decode_tokens
        if num_decode:
            out[:num_decode] = self._decode(q[:num_decode], kv_cache, metadata, scale)
        for chunk in metadata.prefills:
            # [1, H, n, D]: with a batch dimension SDPA takes its fused CPU kernel
            # (3-D inputs fall back to the unfused math path, 1.7x slower).
            q_chunk = q[chunk.start:chunk.end].transpose(0, 1)[None]
            if chunk.context_len == 0 and not kv_cache.quantized:
                # Nothing cached: attend to the chunk's own fresh K/V (exactly what the
                # cache holds when it stores the model dtype).
                k_seq = k[chunk.start:chunk.end].transpose(0, 1)[None]
                v_seq = v[chunk.start:chunk.end].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(q_chunk, k_seq, v_seq, is_causal=True,
                                                   scale=scale, enable_gqa=True)
            else:
                # Read back from the cache, the chunk included: a quantized cache's later
                # readers see the dequantised values, so this chunk must too.
                k_seq, v_seq = kv_cache.gather(chunk.block_table)
                k_seq = k_seq[:chunk.seq_len].transpose(0, 1)[None]
                v_seq = v_seq[:chunk.seq_len].transpose(0, 1)[None]
                query_pos = torch.arange(chunk.context_len, chunk.seq_len, device=q.device)
                key_pos = torch.arange(chunk.seq_len, device=q.device)
                mask = key_pos[None, :] <= query_pos[:, None]  # [n, seq_len]
                o = F.scaled_dot_product_attention(q_chunk, k_seq, v_seq, attn_mask=mask,
                                                   scale=scale, enable_gqa=True)
            out[chunk.start:chunk.end] = o[0].transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        keys, values = kv_cache.gather(metadata.decode_block_tables)  # [D, L, KVH, Dh]
        rows, query_len = keys.shape[0], metadata.decode_query_len
        group = q.shape[1] // keys.shape[2]
        if query_len > 1:  # rows' tokens into a [D * Q] grid (padding queries are zero)
            grid = q.new_zeros(rows * query_len, *q.shape[1:])
            grid.index_copy_(0, metadata.decode_query_index, q)
            q = grid
        # Every layer of the step shares the mask laid out for the grouped rows.
        mask = metadata.grouped_masks.get(group)
        if mask is None:
            mask = metadata.grouped_masks[group] = group_mask(metadata.decode_mask, group)
        o = grouped_decode_attention(q, keys, values, mask, query_len, scale)
        if query_len == 1:
            return o
        return o.index_select(0, metadata.decode_query_index)


def group_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """A decode mask [D, 1, Q, L] for grouped query rows (g, r): [D, 1, G * Q, L]."""
    rows, _, query_len, length = mask.shape
    if query_len == 1 or group == 1:
        return mask  # [D, 1, 1, L] broadcasts over the rows
    return (mask[:, :, None].expand(rows, 1, group, query_len, length)
            .reshape(rows, 1, group * query_len, length))


def grouped_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             mask: torch.Tensor, query_len: int,
                             scale: float | None = None) -> torch.Tensor:
    """Attention of a [D * Q, H, Dh] query grid over keys and values [D, L, KVH, Dh]
    (as the cache's gather returns them) under group_mask's mask; [D * Q, H, Dh].

    The G = H / KVH query heads that share a KV head become that head's query rows,
    [D, KVH, G * Q, Dh] (ordered (g, r)): one product per KV head, instead of SDPA's
    enable_gqa broadcast, which measured 1.2-1.4x slower at one query per request
    (8-32 requests) and up to 2.2x slower with speculative rows
    (`benchmarks/bench_decode_attention.py`, docs/BENCHMARKS.md).
    """
    rows, _, kv_heads, head_dim = keys.shape
    heads = q.shape[1]
    group = heads // kv_heads
    queries = (q.view(rows, query_len, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
               .reshape(rows, kv_heads, group * query_len, head_dim))
    o = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=mask, scale=scale)  # [D, KVH, G * Q, Dh]
    return (o.view(rows, kv_heads, group, query_len, head_dim).permute(0, 3, 1, 2, 4)
            .reshape(rows * query_len, heads, head_dim))
