"""Query-aware sparse attention with retrieval heads and a top-p block budget
(`--attention-backend retrieval-topp`; the RTPurbo recipe, training-free).

An offline calibration (`tokenmill calibrate sparse`, attention/sparse_calibration.py)
scores every KV head by how much it attends back to an earlier copy of the text it
is reading, and picks for each a few key dimensions (whole rotary pairs) as its
index. At load, the best-scored --sparse-retrieval-fraction of the sparse layers' KV
heads become retrieval heads; the rest are local heads.

Per decode query of a sparse layer:
- a local head attends to the blocks holding the first --sparse-sink-tokens tokens
  (attention sinks) and the last --sparse-window tokens, and nothing else;
- a retrieval head scores every token with its index (the query's and the key's
  index dimensions only: r of Dh dims, the key side kept beside the cache, r floats
  per token), turns the scores into a distribution (softmax at the attention's
  scale), sums it per block, and keeps, for each query head of the group, blocks in
  order of their mass until the mass reaches --sparse-top-p; the KV head attends to
  the union, plus the sink and window blocks, with at least --sparse-min-tokens and
  at most --sparse-budget tokens (the forced blocks always). The budget is the
  query's: a query whose mass sits in one block keeps little, a spread one keeps
  much;
- attention over the kept keys is exact (block_sparse.BlockSparseAttention).

Sinks and window are whole blocks (so every head's kept set is a list of blocks, which
the in-place route of block_sparse runs through the paged-native kernel). A context
that fits the sinks and the window is dense attention. The first
--sparse-dense-layers layers, prefill chunks and speculative rows run dense.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tokenmill.attention.block_sparse import BlockSparseAttention, native_block_sparse
from tokenmill.attention.sparse_calibration import SparseCalibration
from tokenmill.kv import KVCache


def top_p_blocks(mass: torch.Tensor, top_p: float) -> torch.Tensor:
    """mass [..., W] (a distribution's mass per block) -> bool [..., W]: the blocks,
    taken in order of mass, whose mass before them is under top_p (so the kept mass
    reaches top_p with the fewest blocks)."""
    ordered, order = mass.sort(dim=-1, descending=True, stable=True)
    needed = (ordered.cumsum(-1) - ordered) < top_p
    return torch.zeros_like(needed).scatter_(-1, order, needed)


def clamp_blocks(chosen: torch.Tensor, forced: torch.Tensor, priority: torch.Tensor,
                 valid: torch.Tensor, least: int, most: int) -> torch.Tensor:
    """Kept blocks [..., W] after the floor and ceiling: count = clamp(chosen count,
    least, max(most, forced count)) capped at the valid blocks; the forced come first,
    then the chosen, then the rest, each by priority (in [0, 1])."""
    count = (chosen | forced).sum(-1)
    ceiling = torch.clamp(forced.sum(-1), min=most)
    count = torch.minimum(count.clamp(min=least), ceiling).clamp(max=valid.sum(-1))
    key = forced * 4.0 + chosen * 2.0 + priority
    key = key.masked_fill(~valid, -1.0)
    width = max(1, int(count.max()))
    top = key.topk(width, dim=-1).indices
    keep = torch.arange(width, device=key.device) < count[..., None]
    return torch.zeros_like(valid).scatter_(-1, top, keep) & valid


class RetrievalTopPAttention(BlockSparseAttention):
    name = "retrieval-topp"

    def allocate_sparse_state(self, kv_caches: list[KVCache]) -> None:
        spec, sparse = self.spec, self.spec.sparse
        if sparse.calibration is None or not Path(sparse.calibration).is_file():
            raise ValueError(
                f"sparse_calibration: {self.name} needs a calibration file (not found: "
                f"{sparse.calibration}); run `tokenmill calibrate sparse --model DIR`, "
                "which writes DIR/sparse_calibration.json")
        calibration = SparseCalibration.load(Path(sparse.calibration))
        calibration.check(spec.num_layers, spec.num_kv_heads, spec.head_dim)
        self.retrieval = calibration.retrieval_heads(sparse.dense_layers,
                                                     sparse.retrieval_fraction)
        device = kv_caches[0].data.device
        slots = kv_caches[0].data.shape[1] * spec.block_size
        self.index_dims, self.index = [], []
        for layer, heads in enumerate(self.retrieval):
            dims = [calibration.index_dims_of(layer, head) for head in heads]
            width = len(calibration.index_pairs[layer][0]) * 2
            self.index_dims.append(torch.tensor(dims, dtype=torch.int64, device=device)
                                   .view(len(heads), width))
            self.index.append(torch.zeros(slots if heads else 0, len(heads), width,
                                          device=device))
        self.retrieval_ids = [torch.tensor(heads, dtype=torch.int64, device=device)
                              for heads in self.retrieval]
        self.kernel = None
        if self.native_cache(kv_caches[0] if kv_caches else None):
            self.kernel = native_block_sparse()  # built before the self-check times it

    def probe_classes(self, num_layers: int) -> dict[str, list[int]]:
        """Sparse layers by their number of retrieval heads: a layer of local heads
        only costs far less than one whose heads score every token."""
        classes: dict[str, list[int]] = {}
        for layer in range(min(self.spec.sparse.dense_layers, num_layers - 1), num_layers):
            classes.setdefault(f"{len(self.retrieval[layer])}-retrieval", []).append(layer)
        return classes

    def least_kept(self) -> int:
        sparse = self.spec.sparse
        return max(sparse.min_tokens, sparse.sink_tokens + sparse.window)

    def index_bytes_per_token(self) -> int:
        """What the index adds to the cache, per token over all layers."""
        return sum(index[0].numel() * index.element_size() for index in self.index
                   if index.shape[0])

    def head_kinds(self, layer_index: int) -> list[str]:
        return ["retrieval" if h in self.retrieval[layer_index] else "local"
                for h in range(self.spec.num_kv_heads)]

    def observe_keys(self, layer_index: int, k: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
        heads = self.retrieval[layer_index]
        if not heads or layer_index < self.spec.sparse.dense_layers:
            return
        dims = self.index_dims[layer_index]  # [R, r]
        picked = k[:, heads].float().gather(2, dims[None].expand(k.shape[0], -1, -1))
        self.index[layer_index][slot_mapping] = picked

    def native_lists(self, layer_index: int, q: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, kv_cache: KVCache
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        sparse, block_size = self.spec.sparse, self.spec.block_size
        return self.kernel.topp_select(
            q, tables, lengths, self.index[layer_index], self.index_dims[layer_index],
            self.retrieval_ids[layer_index], block_size,
            math.ceil(sparse.sink_tokens / block_size), sparse.window, sparse.top_p,
            math.ceil(sparse.min_tokens / block_size), max(1, sparse.budget // block_size),
            1 / math.sqrt(self.spec.head_dim))

    def _forced(self, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sink and window blocks [D, W], valid blocks [D, W])."""
        block_size, sparse = self.spec.block_size, self.spec.sparse
        position = torch.arange(width, device=lengths.device)[None, :]
        blocks = (lengths + block_size - 1) // block_size
        valid = position < blocks[:, None]
        first_window = (lengths - sparse.window).clamp(min=0) // block_size
        sinks = position < math.ceil(sparse.sink_tokens / block_size)
        return (sinks | (position >= first_window[:, None])) & valid, valid

    def select_blocks(self, layer_index: int, q: torch.Tensor, tables: torch.Tensor,
                      lengths: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        rows, width = tables.shape
        forced, valid = self._forced(lengths, width)
        mask = forced[:, None].expand(rows, self.spec.num_kv_heads, width).clone()
        heads = self.retrieval[layer_index]
        if not heads:
            return mask
        block_size, sparse = self.spec.block_size, self.spec.sparse
        dims = self.index_dims[layer_index]  # [R, r]
        group = q.shape[2]
        queries = q[:, heads].gather(3, dims[None, :, None].expand(rows, -1, group, -1))
        slots = (tables[..., None] * block_size
                 + torch.arange(block_size, device=q.device)).view(rows, -1)
        keys = self.index[layer_index][slots]  # [D, W * block, R, r]
        scores = torch.einsum("drgk,dnrk->drgn", queries, keys) / math.sqrt(self.spec.head_dim)
        inside = torch.arange(slots.shape[1], device=q.device)[None, :] < lengths[:, None]
        scores = scores.masked_fill(~inside[:, None, None], float("-inf"))
        mass = scores.softmax(-1).view(rows, len(heads), group, width, block_size).sum(-1)
        chosen = top_p_blocks(mass, sparse.top_p).any(2) & valid[:, None]  # [D, R, W]
        kept = clamp_blocks(chosen, forced[:, None].expand_as(chosen), mass.amax(2),
                            valid[:, None].expand_as(chosen),
                            math.ceil(sparse.min_tokens / block_size),
                            max(1, sparse.budget // block_size))
        mask[:, heads] = kept
        return mask
