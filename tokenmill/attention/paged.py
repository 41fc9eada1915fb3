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
        if query_len == 1:
            queries = q.unsqueeze(2)  # [D, H, 1, Dh]
        else:
            grid = q.new_zeros(rows * query_len, *q.shape[1:])
            grid.index_copy_(0, metadata.decode_query_index, q)
            queries = grid.view(rows, query_len, *q.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            queries, keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=metadata.decode_mask, scale=scale, enable_gqa=True)  # [D, H, Q, Dh]
        if query_len == 1:
            return o.squeeze(2)
        o = o.transpose(1, 2).reshape(rows * query_len, *q.shape[1:])
        return o.index_select(0, metadata.decode_query_index)
