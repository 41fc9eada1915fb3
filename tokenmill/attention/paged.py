"""Reference paged attention in plain PyTorch (CPU and CUDA).

Decode rows are gathered through their block tables into one padded batch and run
as a single masked SDPA call; each prefill chunk runs causally against its cached
context plus itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.base import AttentionBackend, AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given blocks as [..., num_blocks * block_size, KVH, D]."""
    keys = kv_cache[0][block_table]
    values = kv_cache[1][block_table]
    shape = (*block_table.shape[:-1], -1, *kv_cache.shape[3:])
    return keys.reshape(shape), values.reshape(shape)


class PagedAttention(AttentionBackend):
    name = "paged"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
                ) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.slot_mapping)
        out = torch.empty_like(q)
        num_decode = metadata.num_decode_tokens
        if num_decode:
            out[:num_decode] = self._decode(q[:num_decode], kv_cache, metadata, scale)
        for chunk in metadata.prefills:
            q_chunk = q[chunk.start:chunk.end].transpose(0, 1)  # [H, n, D]
            if chunk.context_len == 0:
                # Nothing cached: attend to the chunk's own fresh K/V.
                k_seq = k[chunk.start:chunk.end].transpose(0, 1)
                v_seq = v[chunk.start:chunk.end].transpose(0, 1)
                o = F.scaled_dot_product_attention(q_chunk, k_seq, v_seq, is_causal=True,
                                                   scale=scale, enable_gqa=True)
            else:
                k_seq, v_seq = gather_kv(kv_cache, chunk.block_table)
                k_seq = k_seq[:chunk.seq_len].transpose(0, 1)
                v_seq = v_seq[:chunk.seq_len].transpose(0, 1)
                query_pos = torch.arange(chunk.context_len, chunk.seq_len, device=q.device)
                key_pos = torch.arange(chunk.seq_len, device=q.device)
                mask = key_pos[None, :] <= query_pos[:, None]  # [n, seq_len]
                o = F.scaled_dot_product_attention(q_chunk, k_seq, v_seq, attn_mask=mask,
                                                   scale=scale, enable_gqa=True)
            out[chunk.start:chunk.end] = o.transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        keys, values = gather_kv(kv_cache, metadata.decode_block_tables)  # [D, L, KVH, Dh]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [D, H, 1, Dh]
            keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=metadata.decode_mask, scale=scale, enable_gqa=True)
        return o.squeeze(2)
