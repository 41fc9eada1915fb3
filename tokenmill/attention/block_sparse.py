"""What every block-sparse decode backend shares (quest, static-topk, retrieval-topp).

A sparse backend decides, per decode row and KV head, which of the row's KV blocks to
keep (`select_blocks`: a boolean mask over the row's logical blocks, which must keep
each row's last block, the one its query sits in); attention then runs exactly over
the tokens of those blocks, in context order. Two routes compute it:

- in place (float32 cache on the CPU): the heads are grouped by identical masks (all
  local heads of retrieval-topp share one), and per group the paged-native kernel
  runs once over a virtual block table of the kept blocks (its length: the kept
  blocks, the last one partly filled), the group's heads taken from its output;
- gathered (any other cache): the kept blocks' K/V are gathered per KV head
  (dequantised if the cache is quantized) and one masked SDPA runs over them.

The two agree to float32 rounding. The first `sparse.dense_layers` layers, prefill
chunks (unless --sparse-prefill: sparse_prefill.py), speculative rows and rows whose
context is shorter than the crossover
(`--sparse-min-context`, measured on this machine by default: crossover.py) take the
dense path of paged-native (its kernel, or the paged path where it does not apply).

Per-layer state beside the cache (key bounds, an index) is updated from the fresh
keys of each step (`observe_keys`), which needs the layer index: early exit, which
writes K/V without one, is refused.

Counters: `active_tokens` / `queries` (keys attended per decode query and KV head,
summed over sparse layers), the same per head kind (`kind_counts`) and per layer and
head kind (`layer_counts`), which the engine's metrics and the benchmarks report.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.attention.crossover import crossover_for
from tokenmill.attention.paged import PagedMetadata, PrefillChunk
from tokenmill.attention.paged_native import SOURCE as PAGED_SOURCE
from tokenmill.attention.paged_native import PagedNativeAttention, native_decode
from tokenmill.attention.sparse_prefill import chunk_attention, worth_it
from tokenmill.kv import KVCache
from tokenmill.kv.quant import dequantize
from tokenmill.layers.native import build_extension, build_key

SOURCE = Path(__file__).resolve().parent / "csrc" / "block_sparse_decode.cpp"


@functools.cache  # (no arguments: a lookup per layer costs nothing)
def native_block_sparse():
    """retrieval-topp's compiled selection and every sparse backend's list attention
    (csrc/block_sparse_decode.cpp), or None where they cannot be built."""
    return build_extension("block_sparse_decode", SOURCE, ("-ffast-math",))


def mask_to_blocks(block_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A block mask [D, KVH, W] as (chosen [D, KVH, k], used [D, KVH, k]): each (row,
    head)'s kept logical blocks in context order, k the most any keeps; entries past a
    head's count repeat a valid index and are marked unused."""
    counts = block_mask.sum(-1)  # [D, KVH]
    width = max(1, int(counts.max()))
    # A stable sort of "not kept" puts the kept blocks first, in context order.
    order = torch.sort((~block_mask).to(torch.int8), dim=-1, stable=True).indices
    chosen = order[..., :width]
    used = torch.arange(width, device=block_mask.device) < counts[..., None]
    return torch.where(used, chosen, chosen[..., :1]), used


def head_groups(block_mask: torch.Tensor) -> list[list[int]]:
    """KV heads whose masks [D, KVH, W] are equal on every row, grouped."""
    groups: list[list[int]] = []
    for head in range(block_mask.shape[1]):
        for group in groups:
            if torch.equal(block_mask[:, group[0]], block_mask[:, head]):
                group.append(head)
                break
        else:
            groups.append([head])
    return groups


class BlockSparseAttention(PagedNativeAttention):
    fused_decode = False  # decode rows choose their blocks (_decode)
    dense_context_prefill = False  # chunks with a context: _prefill (--sparse-prefill)
    name = "block-sparse"  # abstract: subclasses register under their own names

    # False: always the gathered route (the tests compare the two).
    in_place = True
    # The native selection and list-attention kernels, where a subclass builds them,
    # and the sources of every kernel its sparse and dense decode run.
    kernel = None
    native_sources: tuple[Path, ...] = (PAGED_SOURCE, SOURCE)
    # False: the PyTorch selection even where the native one runs (the tests compare).
    native = True

    def native_cache(self, cache: KVCache | None) -> bool:
        """Whether this backend builds its native kernels for a cache like `cache`
        (float32, not quantized, on the CPU, in-place route on)."""
        return (self.native and self.in_place and cache is not None and not cache.quantized
                and cache.data.device.type == "cpu" and cache.data.dtype == torch.float32)

    @property
    def crossover_tag(self) -> str:
        """What the self-check's cached table depends on beyond the knobs: the PyTorch
        route, or the native kernels' text (a changed kernel is timed again)."""
        if self.kernel is None:
            return "torch"
        keys = "".join(build_key(source) for source in self.native_sources)
        return "native-" + hashlib.sha256(keys.encode()).hexdigest()[:12]

    def allocate_state(self, kv_caches: list[KVCache]) -> None:
        super().allocate_state(kv_caches)  # the kernel, built at start-up
        self.active_tokens = 0
        self.queries = 0
        self.prefill_counts = [0, 0]  # keys attended and queries (x KV heads), sparse prefill
        self.kind_counts: dict[str, list[int]] = {}
        self.layer_counts: dict[tuple[int, str], list[int]] = {}
        self._taken: dict[tuple[int, str], tuple[int, int]] = {}
        self.allocate_sparse_state(kv_caches)
        fixed = self.spec.sparse.min_context
        if fixed is None and os.environ.get("TOKENMILL_AUTO_TUNE", "1") == "0":
            fixed = 0  # no measurement (the test suite): always sparse
        # Per layer: decode rows with a shorter context run dense there.
        self.layer_min_context = [fixed or 0] * len(kv_caches)
        if fixed is None and kv_caches:
            for tag, layers in self.probe_classes(len(kv_caches)).items():
                crossover = crossover_for(self, kv_caches[layers[0]], layers[0],
                                          super()._decode, self._sparse, tag, layers)
                for layer in layers:
                    self.layer_min_context[layer] = crossover
            self.kind_counts.clear()  # the probe's
            self.layer_counts.clear()
            self.active_tokens = self.queries = 0

    @property
    def min_context(self) -> int:
        """The shortest context any sparse layer decodes sparsely from."""
        sparse_layers = self.layer_min_context[self.spec.sparse.dense_layers:]
        return min(sparse_layers) if sparse_layers else 0

    def allocate_sparse_state(self, kv_caches: list[KVCache]) -> None:
        """Allocate per-layer state beside the cache (before the self-check runs)."""

    def _rows(self, metadata: PagedMetadata, rows: torch.Tensor) -> PagedMetadata:
        """The metadata of a subset of the decode rows."""
        return dataclasses.replace(
            metadata, num_decode_tokens=len(rows),
            decode_block_tables=metadata.decode_block_tables[rows],
            decode_mask=None if metadata.decode_mask is None else metadata.decode_mask[rows],
            decode_lengths=metadata.decode_lengths[rows])

    def take_counts(self) -> dict[tuple[int, str], tuple[int, int]]:
        """Per (layer, head kind), (keys attended, queries) since the last call (the
        worker reports them per step); `layer_counts` keeps the totals."""
        taken = {}
        for key, (keys, queries) in self.layer_counts.items():
            before = self._taken.get(key, (0, 0))
            if queries > before[1]:
                taken[key] = (keys - before[0], queries - before[1])
            self._taken[key] = (keys, queries)
        return taken

    def probe_classes(self, num_layers: int) -> dict[str, list[int]]:
        """The sparse layers grouped by what their decode costs alike (all alike here):
        the self-check times the first layer of each group for the whole group."""
        return {"": list(range(min(self.spec.sparse.dense_layers, num_layers - 1),
                               num_layers))}

    def least_kept(self) -> int:
        """The fewest tokens the rule keeps of a long context (sparse prefill's bar)."""
        return self.spec.sparse.budget

    def head_kinds(self, layer_index: int) -> list[str]:
        """The kind of each KV head of a sparse layer, for the counters."""
        return ["selected"] * self.spec.num_kv_heads

    def observe_keys(self, layer_index: int, k: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
        """Update per-layer state from the step's fresh keys [T, KVH, Dh]."""

    def select_blocks(self, layer_index: int, q: torch.Tensor, tables: torch.Tensor,
                      lengths: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """[D, KVH, W] bool: the logical blocks each (row, KV head) attends to, for the
        rows' queries q [D, KVH, G, Dh] (a row's blocks past its length unset)."""
        raise NotImplementedError

    def native_lists(self, layer_index: int, q: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, kv_cache: KVCache
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """select_blocks' choice from a native kernel (where `kernel` is built), as
        (lists [D, KVH, W] of kept logical blocks in context order, counts [D, KVH]:
        how many of each list are valid); q [D, KVH, G, Dh] contiguous float32."""
        raise NotImplementedError

    def runs_native(self, q: torch.Tensor, kv_cache: KVCache) -> bool:
        """Whether native_lists and the list attention serve these queries and cache."""
        return (self.kernel is not None and q.dtype == torch.float32
                and not kv_cache.quantized and kv_cache.data.dtype == torch.float32)

    def choose_blocks(self, layer_index: int, q: torch.Tensor, tables: torch.Tensor,
                      lengths: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """select_blocks' mask [D, KVH, W], from the native choice where it runs."""
        if not self.runs_native(q, kv_cache):
            return self.select_blocks(layer_index, q, tables, lengths, kv_cache)
        lists, counts = self.native_lists(layer_index, q.contiguous(), tables, lengths,
                                          kv_cache)
        width = tables.shape[1]
        valid = torch.arange(width, device=q.device) < counts[..., None]
        mask = torch.zeros(*counts.shape, width + 1, dtype=torch.bool, device=q.device)
        return mask.scatter_(2, torch.where(valid, lists, width), True)[..., :width]

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                 metadata: PagedMetadata) -> None:
        raise NotImplementedError(f"{self.name} keeps per-layer state: early exit, which "
                                  "writes K/V without a layer index, is not supported")

    def forward(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, metadata: PagedMetadata, scale: float) -> torch.Tensor:
        self.observe_keys(layer_index, k, metadata.slot_mapping)
        return super().forward(layer_index, q, k, v, kv_cache, metadata, scale)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 chunk: PrefillChunk, kv_cache: KVCache, scale: float,
                 layer_index: int) -> torch.Tensor:
        sparse = self.spec.sparse
        if (sparse.prefill and layer_index >= sparse.dense_layers and chunk.context_len > 0
                and worth_it(chunk, self.least_kept())):
            return chunk_attention(self, layer_index, q, chunk, kv_cache, scale)
        return super()._prefill(q, k, v, chunk, kv_cache, scale, layer_index)

    def _decode(self, q: torch.Tensor, kv_cache: KVCache, metadata: PagedMetadata,
                scale: float, layer_index: int) -> torch.Tensor:
        if layer_index < self.spec.sparse.dense_layers or metadata.decode_query_len != 1:
            return super()._decode(q, kv_cache, metadata, scale, layer_index)
        sparse_rows = metadata.decode_lengths >= self.layer_min_context[layer_index]
        if bool(sparse_rows.all()):
            return self._sparse(q, kv_cache, metadata, scale, layer_index)
        if not bool(sparse_rows.any()):
            return super()._decode(q, kv_cache, metadata, scale, layer_index)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for rows, route in ((sparse_rows.nonzero().flatten(), self._sparse),
                            ((~sparse_rows).nonzero().flatten(), super()._decode)):
            out[rows] = route(q[rows], kv_cache, self._rows(metadata, rows), scale,
                              layer_index)
        return out

    def _sparse(self, q: torch.Tensor, kv_cache: KVCache, metadata: PagedMetadata,
                scale: float, layer_index: int) -> torch.Tensor:
        block_size, kv_heads = self.spec.block_size, self.spec.num_kv_heads
        tables = metadata.decode_block_tables  # [D, W]
        rows, width = tables.shape
        group = q.shape[1] // kv_heads
        lengths = metadata.decode_lengths  # its context and its own token
        if self.runs_native(q, kv_cache):
            q = q.contiguous()
            lists, counts = self.native_lists(
                layer_index, q.view(rows, kv_heads, group, q.shape[2]), tables, lengths,
                kv_cache)
            return self._attend_lists(lists, counts, q, kv_cache, metadata, scale,
                                      layer_index)
        grouped = q.view(rows, kv_heads, group, q.shape[2])
        block_mask = self.select_blocks(layer_index, grouped.float(), tables, lengths,
                                        kv_cache)
        # Tokens each block holds (the last one partly filled), for the counters.
        starts = torch.arange(width, device=q.device) * block_size
        filled = (lengths[:, None] - starts).clamp(0, block_size)  # [D, W]
        self._count(layer_index, (block_mask * filled[:, None]).sum(-1))
        kernel = native_decode() if self.in_place and q.device.type == "cpu" else None
        last = ((lengths - 1) // block_size)[:, None, None].expand(rows, kv_heads, 1)
        if (kernel is not None and not kv_cache.quantized and q.dtype == torch.float32
                and kv_cache.data.dtype == torch.float32
                and bool(block_mask.gather(2, last).all())):  # the contract, checked
            return self._in_place(kernel, q, block_mask, tables, lengths, kv_cache, scale)
        return self._gathered(grouped, block_mask, tables, lengths, kv_cache, scale)

    def _attend_lists(self, lists: torch.Tensor, counts: torch.Tensor, q: torch.Tensor,
                      kv_cache: KVCache, metadata: PagedMetadata, scale: float,
                      layer_index: int) -> torch.Tensor:
        """Count and attend to a native selection: lists [D, KVH, W] of kept logical
        blocks in context order, the first counts [D, KVH] of each valid (the float32
        CPU cache, in place: block_sparse_decode.cpp's paged_decode_lists)."""
        block_size = self.spec.block_size
        tables, lengths = metadata.decode_block_tables, metadata.decode_lengths
        partial = lengths - (lengths - 1) // block_size * block_size  # the last block's
        self._count(layer_index, counts * block_size - (block_size - partial)[:, None])
        return self.kernel.paged_decode_lists(q, kv_cache.data[0], kv_cache.data[1], tables,
                                              lengths, lists, counts, scale)

    def _in_place(self, kernel, q: torch.Tensor, block_mask: torch.Tensor,
                  tables: torch.Tensor, lengths: torch.Tensor, kv_cache: KVCache,
                  scale: float) -> torch.Tensor:
        block_size = self.spec.block_size
        group = q.shape[1] // self.spec.num_kv_heads
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q = q.contiguous()
        last = (lengths - 1) // block_size
        partial = lengths - last * block_size  # tokens of the last block
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for heads in head_groups(block_mask):
            chosen, used = mask_to_blocks(block_mask[:, heads[:1]])
            virtual = tables.gather(1, chosen[:, 0]).contiguous()
            length = (used[:, 0].sum(-1) - 1) * block_size + partial
            result = kernel.paged_decode(q, kv_cache.data[0], kv_cache.data[1], virtual,
                                         length.contiguous(), scale)
            for head in heads:
                out[:, head * group:(head + 1) * group] = result[:, head * group:
                                                                 (head + 1) * group]
        return out

    def _gathered(self, grouped: torch.Tensor, block_mask: torch.Tensor,
                  tables: torch.Tensor, lengths: torch.Tensor, kv_cache: KVCache,
                  scale: float) -> torch.Tensor:
        block_size, kv_heads = self.spec.block_size, self.spec.num_kv_heads
        rows, _, group, head_dim = grouped.shape
        chosen, used = mask_to_blocks(block_mask)  # [D, KVH, k]
        physical = tables.gather(1, chosen.reshape(rows, -1)).view_as(chosen)
        head = torch.arange(kv_heads, device=grouped.device)[None, :, None]
        keys = kv_cache.data[0][physical, :, head]  # [D, KVH, k, block, Dh]
        values = kv_cache.data[1][physical, :, head]
        if kv_cache.quantized:
            dtype = kv_cache.compute_dtype
            keys = dequantize(keys, kv_cache.scales[0][physical, :, head], dtype)
            values = dequantize(values, kv_cache.scales[1][physical, :, head], dtype)
        count = chosen.shape[-1]
        keys = keys.reshape(rows, kv_heads, count * block_size, head_dim)
        values = values.reshape(rows, kv_heads, count * block_size, head_dim)
        positions = (chosen[..., None] * block_size
                     + torch.arange(block_size, device=grouped.device)
                     ).reshape(rows, kv_heads, -1)
        mask = ((positions < lengths[:, None, None])
                & used.repeat_interleave(block_size, dim=-1))  # [D, KVH, k * block]
        out = F.scaled_dot_product_attention(
            grouped, keys.to(grouped.dtype), values.to(grouped.dtype),
            attn_mask=mask[:, :, None, :], scale=scale)  # [D, KVH, G, Dh]
        return out.reshape(rows, kv_heads * group, head_dim)

    def _count(self, layer_index: int, keys: torch.Tensor) -> None:
        """keys [D, KVH]: keys each row's query attended per KV head."""
        per_head = keys.sum(0).tolist()
        rows = keys.shape[0]
        for kind, count in zip(self.head_kinds(layer_index), per_head, strict=True):
            for entry in (self.kind_counts.setdefault(kind, [0, 0]),
                          self.layer_counts.setdefault((layer_index, kind), [0, 0])):
                entry[0] += int(count)
                entry[1] += rows
        self.active_tokens += int(sum(per_head))
        self.queries += rows * len(per_head)
