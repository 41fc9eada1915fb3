"""Paged attention whose decode rows read the KV cache in place (`paged-native`, the
default backend).

The `paged` backend gathers every decode row's whole context out of the block pool
into a padded batch, each layer of each step, and runs one masked SDPA over it. Here
a small C++ kernel (csrc/paged_decode.cpp, compiled for this CPU at first use) walks
each request's block table instead: a work item is a request's run of blocks (split
into shares when requests are fewer than threads), each block read front to back with
all heads and folded into a running softmax per query head while the next block is
prefetched, so the context is read once, where it lies, with no copy and no padding to
the longest request. Prefill chunks and speculative (multi-token) decode rows, a
quantized cache, a non-float32 model or a device without the kernel take the `paged`
path unchanged. The sums run in another order than SDPA's: outputs agree to float32
rounding, not bit for bit.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tokenmill.attention.paged import PagedAttention, PagedMetadata
from tokenmill.kv import KVCache
from tokenmill.layers.native import build_extension

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode.cpp"


@functools.cache  # (no arguments: a lookup per layer costs nothing)
def native_decode():
    """The compiled kernel module, or None where it cannot be built."""
    return build_extension("paged_decode", SOURCE, ("-ffast-math",))


class PagedNativeAttention(PagedAttention):
    name = "paged-native"

    def allocate_state(self, kv_caches: list[KVCache]) -> None:
        # Build (or load) the kernel at start-up, not in the first request's decode:
        # compiling takes ~30 s once per CPU and torch version.
        cache = kv_caches[0] if kv_caches else None
        if (cache is not None and cache.data.device.type == "cpu" and not cache.quantized
                and cache.data.dtype == torch.float32):
            native_decode()

    def _decode(self, q: torch.Tensor, kv_cache: KVCache, metadata: PagedMetadata,
                scale: float, layer_index: int) -> torch.Tensor:
        kernel = native_decode() if q.device.type == "cpu" else None
        if (kernel is None or metadata.decode_lengths is None or kv_cache.quantized
                or q.dtype != torch.float32 or kv_cache.data.dtype != torch.float32):
            return super()._decode(q, kv_cache, metadata, scale, layer_index)
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # rows may be strided, not heads
            q = q.contiguous()
        return kernel.paged_decode(q, kv_cache.data[0], kv_cache.data[1],
                                   metadata.decode_block_tables, metadata.decode_lengths,
                                   scale)
