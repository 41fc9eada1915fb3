"""Paged attention whose decode rows read the KV cache in place (`paged-native`, the
default backend).

The `paged` backend gathers every decode row's whole context out of the block pool
into a padded batch, each layer of each step, and runs one masked SDPA over it. Here
a small C++ kernel (csrc/paged_decode.cpp, compiled for this CPU at first use) walks
each request's block table instead: a work item is a request's run of tokens (split
into shares when requests are fewer than threads), read in 16-token tiles of whole
token rows (all KV heads) and folded into a running softmax per query head while the
next tile is prefetched (into L1 or L2, whichever this host measured faster at start-up:
kv_fetch.py), so the context is read once, where it lies, with no copy and
no padding to the longest request. A decode-only step writes its K/V in the same
call, and is taken whole from each layer's qkv projection (decode_qkv: the rotary
embedding too, so the layer runs no split, views or rotation of its own). A
speculative (multi-token) decode row's tokens are rows of their own for the kernel,
each with its causal key count.

A step's prefill chunks whose sequences (cached context + chunk) are up to a length
measured on this machine run through a second kernel, all in one call, reading the
cache in place too (prefill_native.py). Longer ones, a quantized cache, a non-float32
model or a device without the kernels take the `paged` path unchanged. The sums run in
another order than SDPA's: outputs agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from tokenmill.attention import kv_fetch, prefill_native
from tokenmill.attention.base import BatchLayout
from tokenmill.attention.paged import PagedAttention, PagedMetadata
from tokenmill.attention.prefill_native import native_prefill
from tokenmill.kv import KVCache
from tokenmill.layers.native import build_extension

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode.cpp"
FLAGS = ("-ffast-math",)


@functools.cache  # (no arguments: a lookup per layer costs nothing)
def native_decode():
    """The compiled kernel module, or None where it cannot be built."""
    return build_extension("paged_decode", SOURCE, FLAGS)


@functools.cache  # (per kernel module: read once, looked up per step)
def _entry_points(kernel) -> dict[str, int]:
    return kernel.entry_points()


class PagedNativeAttention(PagedAttention):
    name = "paged-native"
    # Decode rows attend to every key of their context, so a decode-only step's K/V
    # write and attention can be one compiled call (a backend that chooses keys, as
    # the sparse ones do, routes its decode rows through _decode instead).
    fused_decode = True
    # Longest prefill sequence (context + chunk) the native prefill kernel takes
    # (measured in allocate_state, where the cache is a float32 one on the CPU and the
    # kernel builds; 0 otherwise: the paged path).
    prefill_limit = 0
    # Chunks behind a cached context through that kernel too (a sparse backend, which
    # chooses their context keys itself, keeps them on its own path).
    dense_context_prefill = True

    # Whether decode-only steps go whole through the kernel from each layer's qkv
    # projection (decode_qkv: a float32 cache on the CPU with the kernel built), and
    # each layer's key and value pools for it, taken once per cache tensor.
    whole_decode_ready = False
    _pools: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    def allocate_state(self, kv_caches: list[KVCache]) -> None:
        # Build (or load) the kernel at start-up, not in the first request's decode:
        # compiling takes ~30 s once per CPU and torch version.
        cache = kv_caches[0] if kv_caches else None
        self._pools = {}
        if (cache is not None and cache.data.device.type == "cpu" and not cache.quantized
                and cache.data.dtype == torch.float32):
            decode = native_decode()
            self.whole_decode_ready = self.fused_decode and decode is not None
            if decode is not None:  # the prefetch level this host reads a cold pool best at
                kv_fetch.configure(decode, SOURCE, FLAGS, self.spec.num_heads,
                                   self.spec.num_kv_heads, self.spec.head_dim)
            kernel = native_prefill()
            if kernel is not None and self.spec.head_dim % kernel.lanes() == 0:
                self.prefill_limit = prefill_native.longest_sequence(
                    kernel, self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim)

    def wants_decode_mask(self) -> bool:
        return not self.whole_decode_ready  # the kernel reads key counts

    def forward(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, metadata: PagedMetadata, scale: float) -> torch.Tensor:
        routed = self._kernel(q, kv_cache, metadata) if self.fused_decode else None
        if routed is None or metadata.num_decode_tokens != q.shape[0]:
            return super().forward(layer_index, q, k, v, kv_cache, metadata, scale)
        # Decode rows only: the write and the attention are one compiled call.
        kernel, tables, lengths = routed
        return kernel.write_and_decode(_heads_contiguous(q), _heads_contiguous(k),
                                       _heads_contiguous(v), metadata.slot_mapping,
                                       kv_cache.data[0], kv_cache.data[1], tables, lengths,
                                       scale)

    def takes_whole_decode(self, metadata: PagedMetadata) -> bool:
        return metadata.qkv_route is not None

    def decode_qkv(self, layer_index: int, qkv: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor], num_heads: int,
                   kv_cache: KVCache | None, metadata: PagedMetadata, scale: float
                   ) -> torch.Tensor | None:
        route = metadata.qkv_route
        if (route is None or kv_cache is None or qkv.dtype != torch.float32
                or not qkv.is_contiguous()):
            return None
        kernel, tables, lengths = route
        keys, values = self._layer_pools(layer_index, kv_cache)
        return kernel.rope_write_and_decode(qkv, rope[0], rope[1], metadata.slot_mapping,
                                            keys, values, tables, lengths, scale, num_heads)

    def _layer_pools(self, layer_index: int, kv_cache: KVCache
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value pools, views taken once per cache tensor."""
        pools = self._pools.get(layer_index)
        if pools is None or pools[0] is not kv_cache.data:
            data = kv_cache.data
            pools = self._pools[layer_index] = (data, data[0], data[1])
        return pools[1], pools[2]

    def decode_pools(self, kv_caches: list[KVCache]
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        if not self.whole_decode_ready:
            return None
        pools = [self._layer_pools(index, cache) for index, cache in enumerate(kv_caches)]
        return [keys for keys, _ in pools], [values for _, values in pools]

    def decode_entry(self, metadata: PagedMetadata
                     ) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        route = metadata.qkv_route
        if route is None:
            return None
        kernel, tables, lengths = route
        entry = _entry_points(kernel)["rope_write_and_decode_into"]
        return entry, metadata.slot_mapping, tables, lengths

    def build_metadata(self, layout: BatchLayout) -> PagedMetadata:
        metadata = super().build_metadata(layout)
        if self.whole_decode_ready and not metadata.prefills and metadata.num_decode_tokens:
            tables, lengths = ((metadata.decode_block_tables, metadata.decode_lengths)
                               if metadata.decode_lengths is not None else
                               (metadata.decode_token_tables, metadata.decode_token_lengths))
            if lengths is not None:
                metadata = dataclasses.replace(
                    metadata, qkv_route=(native_decode(), tables, lengths))
        if not self.prefill_limit:
            return metadata
        taken, rest = [], []
        for chunk in metadata.prefills:
            takes = (chunk.seq_len <= self.prefill_limit
                     and (chunk.context_len == 0 or self.dense_context_prefill))
            (taken if takes else rest).append(chunk)
        if not taken:
            return metadata
        return dataclasses.replace(metadata,
                                   native_prefill=prefill_native.prepare(taken, rest))

    def _prefill_chunks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        metadata: PagedMetadata, kv_cache: KVCache, scale: float,
                        layer_index: int, out: torch.Tensor) -> None:
        batch = metadata.native_prefill
        if batch is None:
            return super()._prefill_chunks(q, k, v, metadata, kv_cache, scale, layer_index,
                                           out)
        # The chunks' K/V were written to the cache when the layer's step began.
        prefill_native.run(native_prefill(), _heads_contiguous(q), kv_cache.data[0],
                           kv_cache.data[1], out, batch, scale)
        for chunk in batch.rest:
            out[chunk.start:chunk.end] = self._prefill(q, k, v, chunk, kv_cache, scale,
                                                       layer_index)

    def _decode(self, q: torch.Tensor, kv_cache: KVCache, metadata: PagedMetadata,
                scale: float, layer_index: int) -> torch.Tensor:
        routed = self._kernel(q, kv_cache, metadata)
        if routed is None:
            return super()._decode(q, kv_cache, metadata, scale, layer_index)
        kernel, tables, lengths = routed
        return kernel.paged_decode(_heads_contiguous(q), kv_cache.data[0], kv_cache.data[1],
                                   tables, lengths, scale)

    @staticmethod
    def _kernel(q: torch.Tensor, kv_cache: KVCache, metadata: PagedMetadata):
        """(the compiled kernel, block tables, key counts) for this step's decode
        tokens, one row each (a speculative row's tokens are rows of their own, each
        with its causal key count), or None where the kernel does not apply."""
        kernel = native_decode() if q.device.type == "cpu" else None
        if (kernel is None or kv_cache.quantized or q.dtype != torch.float32
                or kv_cache.data.dtype != torch.float32):
            return None
        if metadata.decode_lengths is not None:
            return kernel, metadata.decode_block_tables, metadata.decode_lengths
        if metadata.decode_token_lengths is not None:
            return kernel, metadata.decode_token_tables, metadata.decode_token_lengths
        return None


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with each row's heads contiguous (rows may be strided)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
