"""Quest: query-aware sparse attention for decode rows (`--attention-backend quest`).

Beside every layer's paged cache the backend keeps, per block and KV head, the
elementwise minimum and maximum of the block's keys (updated as keys are written; a
block's bounds restart when its first slot is written, so a freed and reused block
forgets its old keys). For a decode query q the largest score any key of a block can
reach is bounded by sum_d max(q_d * min_d, q_d * max_d) (Tang et al., "Quest", ICML
2024); a KV head takes the largest bound over the query heads that share it. Each
(request, KV head) then attends, exactly, to the blocks with the highest bounds, up to
--sparse-budget tokens, always including the first block (attention sinks) and the
block holding the query's own token; the kept blocks stay in context order.

A request whose context fits the budget keeps every block: below the budget this is
dense attention (the same keys, the same order). The first --sparse-dense-layers
layers stay dense (the paper keeps layers 0-1 dense; reproductions that made every
layer sparse collapsed). Prefill chunks and speculative rows take the paged path.
With a quantized cache the bounds are of the keys before quantization (a stored key
can exceed them by its rounding): selection is a heuristic there, attention over the
kept blocks still exact.

Counters: `active_tokens` / `queries` (keys attended per decode query and KV head,
summed over sparse layers), which the engine's metrics and the benchmarks report.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.paged import PagedAttention, PagedMetadata
from tokenmill.kv import KVCache
from tokenmill.kv.quant import dequantize


def block_upper_bounds(q: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor
                       ) -> torch.Tensor:
    """Quest's bound per (row, block, KV head): q [D, KVH, G, Dh], key_min / key_max
    [D, W, KVH, Dh] (the rows' blocks) -> [D, W, KVH], the largest q . k any key between
    the bounds can give, maximised over the G query heads of each KV head."""
    q = q[:, None]  # [D, 1, KVH, G, Dh]
    low, high = key_min[:, :, :, None], key_max[:, :, :, None]
    return torch.maximum(q * low, q * high).sum(-1).amax(-1)


def select_blocks(bounds: torch.Tensor, num_blocks: torch.Tensor, keep: int) -> torch.Tensor:
    """The kept logical blocks per (row, KV head), in context order: [D, KVH, k] with
    k = min(max(keep, 2), W). bounds [D, W, KVH]; num_blocks [D]: blocks each row has. The first
    and the last block of a row always stay; a row with at most `keep` blocks keeps all.
    Rows with fewer blocks than k repeat their last block (callers mask the repeats)."""
    rows, width, _ = bounds.shape
    position = torch.arange(width, device=bounds.device)
    valid = position[None, :] < num_blocks[:, None]
    forced = (position[None, :] == 0) | (position[None, :] == num_blocks[:, None] - 1)
    scores = bounds.masked_fill(forced[:, :, None], float("inf"))
    scores = scores.masked_fill(~valid[:, :, None], float("-inf"))
    k = min(max(keep, 2), width)  # room for the two forced blocks
    chosen = scores.topk(k, dim=1).indices  # [D, k, KVH]
    # Invalid picks (rows shorter than k) point at the row's last block.
    chosen = torch.minimum(chosen, (num_blocks - 1)[:, None, None])
    return chosen.sort(dim=1).values.transpose(1, 2)  # [D, KVH, k]


class QuestAttention(PagedAttention):
    name = "quest"

    def allocate_state(self, kv_caches: list[KVCache]) -> None:
        shape = (kv_caches[0].data.shape[1], self.spec.num_kv_heads, self.spec.head_dim)
        device = kv_caches[0].data.device
        self.key_min = [torch.full(shape, float("inf"), device=device) for _ in kv_caches]
        self.key_max = [torch.full(shape, float("-inf"), device=device) for _ in kv_caches]
        self.active_tokens = 0
        self.queries = 0
        self._taken = (0, 0)

    def take_counts(self) -> tuple[int, int]:
        """(keys attended, queries) since the last call (the worker reports them per
        step); `active_tokens` and `queries` keep the totals."""
        taken = (self.active_tokens - self._taken[0], self.queries - self._taken[1])
        self._taken = (self.active_tokens, self.queries)
        return taken

    def _update_bounds(self, layer_index: int, k: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
        blocks = slot_mapping // self.spec.block_size
        fresh = blocks[slot_mapping % self.spec.block_size == 0]
        key_min, key_max = self.key_min[layer_index], self.key_max[layer_index]
        key_min[fresh] = float("inf")
        key_max[fresh] = float("-inf")
        k = k.float()
        index = blocks[:, None, None].expand_as(k)
        key_min.scatter_reduce_(0, index, k, "amin")
        key_max.scatter_reduce_(0, index, k, "amax")

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                 metadata: PagedMetadata) -> None:
        raise NotImplementedError("quest keeps key bounds per layer: early exit, which "
                                  "writes K/V without a layer index, is not supported")

    def forward(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, metadata: PagedMetadata, scale: float) -> torch.Tensor:
        self._update_bounds(layer_index, k, metadata.slot_mapping)
        return super().forward(layer_index, q, k, v, kv_cache, metadata, scale)

    def block_scores(self, layer_index: int, q: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """[D, W, KVH]: how much each block of each row promises to the query q
        [D, KVH, G, Dh] (here Quest's upper bound, read from the kept key bounds)."""
        return block_upper_bounds(q, self.key_min[layer_index][tables],
                                  self.key_max[layer_index][tables])

    def _decode(self, q: torch.Tensor, kv_cache: KVCache, metadata: PagedMetadata,
                scale: float, layer_index: int) -> torch.Tensor:
        if layer_index < self.spec.sparse_dense_layers or metadata.decode_query_len != 1:
            return super()._decode(q, kv_cache, metadata, scale, layer_index)
        block_size, kv_heads = self.spec.block_size, self.spec.num_kv_heads
        tables = metadata.decode_block_tables  # [D, W]
        rows, width = tables.shape
        heads, head_dim = q.shape[1], q.shape[2]
        group = heads // kv_heads
        lengths = metadata.decode_lengths  # its context and its own token
        num_blocks = (lengths + block_size - 1) // block_size
        grouped = q.view(rows, kv_heads, group, head_dim).float()
        scores = self.block_scores(layer_index, grouped, tables, lengths, kv_cache)
        keep = max(1, self.spec.sparse_budget // block_size)
        chosen = select_blocks(scores, num_blocks, keep)  # [D, KVH, k]
        physical = tables.gather(1, chosen.reshape(rows, -1)).view_as(chosen)
        head = torch.arange(kv_heads, device=q.device)[None, :, None]
        keys = kv_cache.data[0][physical, :, head]  # [D, KVH, k, block, Dh]
        values = kv_cache.data[1][physical, :, head]
        if kv_cache.quantized:
            dtype = kv_cache.compute_dtype
            keys = dequantize(keys, kv_cache.scales[0][physical, :, head], dtype)
            values = dequantize(values, kv_cache.scales[1][physical, :, head], dtype)
        k_count = chosen.shape[-1]
        keys = keys.reshape(rows, kv_heads, k_count * block_size, head_dim)
        values = values.reshape(rows, kv_heads, k_count * block_size, head_dim)
        positions = (chosen[..., None] * block_size
                     + torch.arange(block_size, device=q.device)).reshape(rows, kv_heads, -1)
        # A repeated block (a row shorter than k blocks) counts once.
        first = torch.ones_like(chosen, dtype=torch.bool)
        first[..., 1:] = chosen[..., 1:] != chosen[..., :-1]
        usable = first.repeat_interleave(block_size, dim=-1)
        mask = (positions < lengths[:, None, None]) & usable  # [D, KVH, k * block]
        self.active_tokens += int(mask.sum())
        self.queries += rows * kv_heads
        out = F.scaled_dot_product_attention(
            q.view(rows, kv_heads, group, head_dim), keys.to(q.dtype), values.to(q.dtype),
            attn_mask=mask[:, :, None, :], scale=scale)  # [D, KVH, G, Dh]
        return out.reshape(rows, heads, head_dim)



class StaticTopKAttention(QuestAttention):
    """`--attention-backend static-topk`: the naive baseline. Each (request, KV head)
    keeps a fixed number of blocks (--sparse-budget tokens) chosen by their exact
    scores (the largest q . k over the block's keys and the KV head's query heads),
    computed from every key of the context: as much reading as dense attention, so it
    saves nothing; it exists to show what a fixed, query-blind budget costs in
    accuracy (the key bounds of Quest are kept but unused)."""

    name = "static-topk"

    def block_scores(self, layer_index: int, q: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        keys, _ = kv_cache.gather(tables)  # [D, W * block, KVH, Dh]
        rows, width = tables.shape
        scores = torch.einsum("dhgk,dthk->dtgh", q, keys.float())  # [D, W * block, G, KVH]
        valid = torch.arange(keys.shape[1], device=q.device)[None, :] < lengths[:, None]
        scores = scores.masked_fill(~valid[:, :, None, None], float("-inf"))
        return scores.view(rows, width, -1, *scores.shape[2:]).amax(dim=(2, 3))
