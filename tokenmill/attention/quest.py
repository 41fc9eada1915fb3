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

On a float32 CPU cache both the choice and the attention are native
(`csrc/topk_select.cpp`, then block_sparse_decode.cpp's list attention); elsewhere the
PyTorch selection below (the native one's reference) and
`block_sparse.BlockSparseAttention`'s gathering and exact attention serve, with its
counters either way.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tokenmill.attention.block_sparse import BlockSparseAttention, native_block_sparse
from tokenmill.kv import KVCache
from tokenmill.layers.native import build_extension

SOURCE = Path(__file__).resolve().parent / "csrc" / "topk_select.cpp"


@functools.cache
def native_topk_select():
    """The compiled block choice of quest and static-topk, or None where it cannot be
    built."""
    return build_extension("topk_select", SOURCE, ("-ffast-math",))


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


class QuestAttention(BlockSparseAttention):
    name = "quest"
    exact_scores = False  # scores from the key bounds (static-topk: from the keys)
    native_sources = (*BlockSparseAttention.native_sources, SOURCE)

    def allocate_sparse_state(self, kv_caches: list[KVCache]) -> None:
        shape = (kv_caches[0].data.shape[1], self.spec.num_kv_heads, self.spec.head_dim)
        device = kv_caches[0].data.device
        self.key_min = [torch.full(shape, float("inf"), device=device) for _ in kv_caches]
        self.key_max = [torch.full(shape, float("-inf"), device=device) for _ in kv_caches]
        self.kernel = self.select_kernel = None
        if self.native_cache(kv_caches[0]):
            # Built before the self-check times them; both or neither.
            self.select_kernel = native_topk_select()
            self.kernel = native_block_sparse() if self.select_kernel is not None else None

    def observe_keys(self, layer_index: int, k: torch.Tensor,
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

    def block_scores(self, layer_index: int, q: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """[D, W, KVH]: how much each block of each row promises to the query q
        [D, KVH, G, Dh] (here Quest's upper bound, read from the kept key bounds)."""
        return block_upper_bounds(q, self.key_min[layer_index][tables],
                                  self.key_max[layer_index][tables])

    def native_lists(self, layer_index: int, q: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, kv_cache: KVCache
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.select_kernel.topk_select(
            q, self.key_min[layer_index], self.key_max[layer_index], kv_cache.data[0], tables,
            lengths, max(1, self.spec.sparse.budget // self.spec.block_size),
            self.exact_scores)

    def select_blocks(self, layer_index: int, q: torch.Tensor, tables: torch.Tensor,
                      lengths: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        block_size = self.spec.block_size
        num_blocks = (lengths + block_size - 1) // block_size
        scores = self.block_scores(layer_index, q, tables, lengths, kv_cache)
        keep = max(1, self.spec.sparse.budget // block_size)
        chosen = select_blocks(scores, num_blocks, keep)  # [D, KVH, k] (repeats allowed)
        mask = torch.zeros(*chosen.shape[:2], tables.shape[1], dtype=torch.bool,
                           device=q.device)
        return mask.scatter_(2, chosen, True)


class StaticTopKAttention(QuestAttention):
    """`--attention-backend static-topk`: the naive baseline. Each (request, KV head)
    keeps a fixed number of blocks (--sparse-budget tokens) chosen by their exact
    scores (the largest q . k over the block's keys and the KV head's query heads),
    computed from every key of the context: as much reading as dense attention, so it
    saves nothing; it exists to show what a fixed, query-blind budget costs in
    accuracy (the key bounds of Quest are kept but unused)."""

    name = "static-topk"
    exact_scores = True

    def block_scores(self, layer_index: int, q: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        keys, _ = kv_cache.gather(tables)  # [D, W * block, KVH, Dh]
        rows, width = tables.shape
        scores = torch.einsum("dhgk,dthk->dtgh", q, keys.float())  # [D, W * block, G, KVH]
        valid = torch.arange(keys.shape[1], device=q.device)[None, :] < lengths[:, None]
        scores = scores.masked_fill(~valid[:, :, None, None], float("-inf"))
        return scores.view(rows, width, -1, *scores.shape[2:]).amax(dim=(2, 3))
