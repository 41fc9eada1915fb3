"""Sparse attention for prefill chunks on a long cached context (`--sparse-prefill`,
off by default; quest, static-topk and retrieval-topp alike).

A chunk of a long prompt (chunked prefill, or a prompt behind a long cached prefix)
attends to its whole cached context in every layer: at 8K of context a 2K chunk's
attention is most of a small model's prefill work. Here a chunk of a sparse layer
attends to the context blocks its backend's decode rule keeps for a few of the
chunk's own queries (PROBE_QUERIES evenly spaced ones, the last among them, each
treated as a decode query on the cached context; the union of their blocks per KV
head), and to the chunk itself causally (dense): per KV head, its query heads over
its kept context tokens, and all heads causally over the chunk, each with torch's
fused CPU kernel (no mask), merged by their log-sum-exps; keys read back from the
cache (dequantised if quantized), as the dense path does. The blocks are chosen by
the backend's native selection where it runs (csrc/), as for decode rows.

It applies where the context is over twice what the selection keeps at least of a
long context (quest, static-topk: the budget; retrieval-topp: the floor, or the
sinks and the window if more); shorter contexts, the first `--sparse-dense-layers`
layers and every decode row are untouched by it.
"""

from __future__ import annotations

import torch

from tokenmill.attention.paged import PrefillChunk, attend, merge
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
    """The chunk's attention output [n, H, Dh] over its kept context and itself: per KV
    head, its query heads over its kept context tokens, and every head causally over
    the chunk, merged by their log-sum-exps (no mask over the whole sequence)."""
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
    kept = backend.choose_blocks(layer_index, grouped, tables, lengths, kv_cache).any(0)

    def read(positions: torch.Tensor, heads: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values of positions of the sequence for some KV heads:
        [1, heads, L, Dh] each (dequantised from a quantized cache, as the dense path
        reads them)."""
        slots = chunk.block_table[positions // block_size] * block_size + positions % block_size
        read = []
        for side in (0, 1):
            rows = kv_cache.data[side].flatten(0, 1)[slots, heads]
            if kv_cache.quantized:
                rows = dequantize(rows, kv_cache.scales[side].flatten(0, 1)[slots, heads],
                                  kv_cache.compute_dtype)
            read.append(rows.transpose(0, 1)[None].to(q.dtype))
        return read[0], read[1]

    queries = q_chunk.transpose(0, 1)[None]  # [1, H, n, Dh]
    keys, values = read(torch.arange(context, chunk.seq_len, device=device), slice(None))
    own = attend(queries, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1),
                 scale, causal=True)
    outputs = []
    context_keys = 0
    for head in range(kv_heads):
        heads = slice(head * group, (head + 1) * group)
        positions = (kept[head].nonzero().flatten()[:, None] * block_size
                     + torch.arange(block_size, device=device)).flatten()
        positions = positions[positions < context]
        context_keys += len(positions)
        if len(positions) == 0:
            outputs.append(own[0][:, heads])
            continue
        keys, values = read(positions, slice(head, head + 1))
        shape = (1, group, len(positions), keys.shape[-1])
        part = attend(queries[:, heads], keys.expand(shape), values.expand(shape), scale,
                      causal=False)
        outputs.append(merge(part, (own[0][:, heads], own[1][:, heads])))
    counts = backend.prefill_counts
    counts[0] += context_keys * n + n * (n + 1) // 2 * kv_heads
    counts[1] += n * kv_heads
    return torch.cat(outputs, dim=1)[0].transpose(0, 1)
