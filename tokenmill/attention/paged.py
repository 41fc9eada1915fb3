"""Reference paged attention in plain PyTorch (CPU and CUDA).

Decode rows (one token, or one plus speculative tokens, per request) are gathered
through their block tables into one padded batch and run as a single masked SDPA
call; each prefill chunk runs causally against its cached
context plus itself. Reads go through `KVCache.gather`, which dequantises a
quantized cache right after the gather.

A chunk with a cached context (chunked prefill of a long prompt, a prompt behind a
cached prefix) runs on the CPU as two calls of torch's fused kernel merged by their
log-sum-exps: the chunk's queries over the context with no mask (each KV head's query
heads as one block of rows, so the context is not repeated per query head), and over
the chunk itself causally. One SDPA call with a [n, context + n] mask computes every
masked score too (no causal skipping): the split measured 1.1-1.5x faster per layer
(`benchmarks/bench_prefill_context.py`, docs/BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.attention.base import AttentionBackend, BatchLayout
from tokenmill.kv import KVCache


@dataclass
class PrefillChunk:
    """One request's chunk of new tokens beyond its cached context."""

    start: int  # offset of the chunk in the flattened batch
    end: int
    context_len: int  # tokens already in the KV cache before this chunk
    block_table: torch.Tensor  # [num_blocks] physical block ids

    @property
    def seq_len(self) -> int:
        return self.context_len + self.end - self.start


@dataclass(frozen=True)
class PagedMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    num_decode_tokens: int
    # Decode rows (tokens [0, num_decode_tokens)): padded block tables, and where each
    # row's queries may look: [D, 1, G * Q, max_blocks * block_size], laid out for the
    # G query heads that share a KV head (see grouped_decode_attention); None for
    # one-token rows where the backend reads decode_lengths instead (wants_decode_mask).
    decode_block_tables: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    # Decode rows carry up to Q tokens (the last real token plus speculative ones).
    # With Q > 1, row i's tokens sit at padded positions decode_query_index (i * Q + r)
    # of a [D * Q] query grid.
    decode_query_len: int = 1
    decode_query_index: torch.Tensor | None = None
    # Keys each one-token decode row attends to (its context and its own token; None
    # with speculative rows): the in-place kernel and the sparse backends read them.
    decode_lengths: torch.Tensor | None = None
    # With speculative rows (Q > 1), per decode token in batch order: its row's block
    # table [T, W] and the keys it attends to (its context and its row's tokens up to
    # itself), so the in-place kernel can take each token as a row of its own.
    decode_token_tables: torch.Tensor | None = None
    decode_token_lengths: torch.Tensor | None = None
    # The paged-native backend's prefill chunks for its kernel, prepared once per step
    # (attention/prefill_native.py PrefillBatch); None: every chunk takes _prefill.
    native_prefill: Any = None
    # A decode-only step the paged-native backend takes whole from each layer's qkv
    # projection (its kernel, block tables, key counts); None: the layers' forward.
    qkv_route: Any = None


class PagedAttention(AttentionBackend):
    name = "paged"

    def build_metadata(self, layout: BatchLayout) -> PagedMetadata:
        decode_rows = range(layout.num_decode_requests)
        device = layout.device
        query_lens = layout.query_lens
        tables = query_len = index = mask = lengths = per_token = None
        if layout.num_decode_requests:
            tables, mask, query_len, index, lengths, per_token = self._decode_metadata(
                layout, decode_rows)
        prefills = []
        for row in range(layout.num_decode_requests, layout.num_requests):
            start, seq_len = layout.query_start[row], layout.context_lens[row] + query_lens[row]
            used = layout.block_tables[row][:-(-seq_len // layout.block_size)]
            prefills.append(PrefillChunk(
                start, start + query_lens[row], layout.context_lens[row],
                torch.tensor(used, dtype=torch.int64, device=device)))
        token_tables, token_lengths = per_token or (None, None)
        return PagedMetadata(layout.slot_mapping, layout.num_decode_tokens, tables, mask,
                             prefills, query_len or 1, index, lengths, token_tables,
                             token_lengths)

    def wants_decode_mask(self) -> bool:
        """Whether one-token decode rows need PagedMetadata.decode_mask at hand."""
        return True

    def _decode_metadata(self, layout: BatchLayout, rows: range
                         ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None,
                                    torch.Tensor | None,
                                    tuple[torch.Tensor, torch.Tensor] | None]:
        device = layout.device
        tables = [layout.block_tables[r] for r in rows]
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        lengths_list = [layout.query_lens[r] for r in rows]
        context_list = [layout.context_lens[r] for r in rows]
        query_len = max(lengths_list)
        index = per_token = mask = None
        if query_len == 1:
            keys = torch.tensor([c + 1 for c in context_list], dtype=torch.int64, device=device)
            # A backend whose kernel reads key counts builds no mask: after a step's
            # weight stream, with the caches cold, its few ops took ~0.1 ms of a
            # one-row step. _decode makes it from the counts if it is ever wanted.
            if self.wants_decode_mask():
                mask = one_token_mask(keys, width * layout.block_size)
        else:
            keys = None
            contexts = torch.tensor(context_list, dtype=torch.int64, device=device)
            key_pos = torch.arange(width * layout.block_size, device=device)
            # Query r of a row sees its context and the row's tokens up to r. Padding
            # queries (rows shorter than query_len) copy the row's last query, so no
            # row is fully masked; their outputs are dropped.
            lengths = torch.tensor(lengths_list, dtype=torch.int64, device=device)
            offsets = torch.arange(query_len, device=device)
            last = torch.minimum(offsets[None, :], (lengths - 1)[:, None])
            limit = contexts[:, None] + last  # [D, query_len]
            mask = (key_pos[None, None, :] <= limit[:, :, None])[:, None]
            index = torch.cat([row * query_len + torch.arange(n, device=device)
                               for row, n in enumerate(lengths_list)])
        group = self.spec.num_heads // self.spec.num_kv_heads
        block_tables = torch.tensor(padded, dtype=torch.int64, device=device)
        if query_len > 1:
            token_rows = torch.repeat_interleave(
                torch.arange(len(lengths_list), device=device), lengths)
            token_offsets = index - token_rows * query_len  # r of each real token
            per_token = (block_tables.index_select(0, token_rows),
                         contexts.index_select(0, token_rows) + token_offsets + 1)
        return (block_tables, None if mask is None else group_mask(mask, group), query_len,
                index, keys, per_token)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                 metadata: PagedMetadata) -> None:
        kv_cache.write(k, v, metadata.slot_mapping)

    def forward(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, metadata: PagedMetadata, scale: float) -> torch.Tensor:
        kv_cache.write(k, v, metadata.slot_mapping)
        num_decode = metadata.num_decode_tokens
        if num_decode == q.shape[0]:  # decode rows only: their output is the step's
            return self._decode(q, kv_cache, metadata, scale, layer_index)
        out = q.new_empty(q.shape)
        if num_decode:
            out[:num_decode] = self._decode(q[:num_decode], kv_cache, metadata, scale,
                                            layer_index)
        self._prefill_chunks(q, k, v, metadata, kv_cache, scale, layer_index, out)
        return out

    def _prefill_chunks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        metadata: PagedMetadata, kv_cache: KVCache, scale: float,
                        layer_index: int, out: torch.Tensor) -> None:
        """Each prefill chunk's attention output into its rows of out."""
        for chunk in metadata.prefills:
            out[chunk.start:chunk.end] = self._prefill(q, k, v, chunk, kv_cache, scale,
                                                       layer_index)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 chunk: PrefillChunk, kv_cache: KVCache, scale: float,
                 layer_index: int) -> torch.Tensor:
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
            o = context_attention(q_chunk, k_seq, v_seq, chunk.context_len, scale)
        return o[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, kv_cache: KVCache, metadata: PagedMetadata,
                scale: float, layer_index: int) -> torch.Tensor:
        keys, values = kv_cache.gather(metadata.decode_block_tables)  # [D, L, KVH, Dh]
        rows, query_len = keys.shape[0], metadata.decode_query_len
        if query_len > 1:  # rows' tokens into a [D * Q] grid (padding queries are zero)
            grid = q.new_zeros(rows * query_len, *q.shape[1:])
            grid.index_copy_(0, metadata.decode_query_index, q)
            q = grid
        mask = metadata.decode_mask
        if mask is None:  # one-token rows whose backend read key counts instead
            mask = one_token_mask(metadata.decode_lengths, keys.shape[1])
        o = grouped_decode_attention(q, keys, values, mask, query_len, scale)
        if query_len == 1:
            return o
        return o.index_select(0, metadata.decode_query_index)


def one_token_mask(keys: torch.Tensor, width: int) -> torch.Tensor:
    """The decode mask [D, 1, 1, width] of one-token rows, row d seeing its first
    keys[d] positions."""
    positions = torch.arange(width, device=keys.device)
    return (positions[None, :] < keys[:, None])[:, None, None, :]


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


def context_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      context: int, scale: float, split: bool | None = None) -> torch.Tensor:
    """Attention of a chunk's queries q [1, H, n, Dh] (positions context .. context +
    n - 1) over keys / values [1, KVH, context + n, Dh]: the whole context, and the
    chunk causally; [1, H, n, Dh].

    split (default: where torch's fused CPU kernel runs, which also returns the
    log-sum-exp) attends to the context and to the chunk in two calls and merges
    them; otherwise one SDPA call under a [n, context + n] mask."""
    if split is None:
        split = fused_cpu_kernel(q)
    heads, n, head_dim = q.shape[1:]
    kv_heads = keys.shape[1]
    if not split:
        query_pos = torch.arange(context, context + n, device=q.device)
        key_pos = torch.arange(context + n, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [n, context + n]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    group = heads // kv_heads
    own = attend(q, keys[:, :, context:].repeat_interleave(group, 1),
                 values[:, :, context:].repeat_interleave(group, 1), scale, causal=True)
    if context == 0:
        return own[0]
    # The G query heads of a KV head as G * n rows of one head: no mask, no repeats.
    rows = q.reshape(1, kv_heads, group * n, head_dim)
    out, lse = attend(rows, keys[:, :, :context], values[:, :, :context], scale,
                      causal=False)
    return merge((out.reshape(1, heads, n, head_dim), lse.reshape(1, heads, n)), own)


def fused_cpu_kernel(q: torch.Tensor) -> bool:
    """Whether torch's fused CPU attention kernel (with its log-sum-exp) runs on q."""
    return q.device.type == "cpu" and q.dtype == torch.float32


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
           causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [1, H, n, Dh] over keys / values [1, H, L, Dh] (causal:
    query i sees keys 0..i) as (output [1, H, n, Dh], log-sum-exp of the scores
    [1, H, n]): torch's fused CPU kernel where it runs, plain products elsewhere."""
    if fused_cpu_kernel(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, keys, values, 0.0, causal, scale=scale)
    scores = (q @ keys.transpose(-1, -2)).float() * scale
    if causal:
        n, length = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n, length, dtype=torch.bool, device=q.device)
                                    .triu(1), float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp().to(q.dtype) @ values, lse


def merge(first: tuple[torch.Tensor, torch.Tensor],
          second: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One softmax's output from attention over two disjoint key sets, each given as
    (output, log-sum-exp): each output weighted by its share of the exponentials."""
    total = torch.logaddexp(first[1], second[1])
    return sum(out * (lse - total).exp()[..., None].to(out.dtype) for out, lse in (first, second))
