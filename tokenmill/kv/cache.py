"""One layer's paged KV cache: the block tensor and, when quantized, its scales.

Layout: data [2, num_blocks, block_size, kv_heads, head_dim] (K then V), in the model
dtype or in int8 / fp8 codes; scales [2, num_blocks, block_size, kv_heads] float32,
one per token per KV head, living in the same blocks (a block's scales are reused
and freed with it, so the block manager needs to know nothing about them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.kv.quant import SCALE_DTYPE, dequantize, is_quantized, quantize


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU its memory comes from calloc (through NumPy), which for
    a large block maps fresh pages the OS hands out zeroed on first touch and skips the
    pass that torch.zeros makes: a pool of gigabytes costs nothing at start-up (zeroing
    5 GB took 10.7 s of a 17.7 s start on this project's VMs), and a block's pages are
    faulted in when it is first written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)


@dataclass
class KVCache:
    data: torch.Tensor
    scales: torch.Tensor | None
    # What attention computes in (and what gather returns).
    compute_dtype: torch.dtype

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 storage: torch.dtype, compute_dtype: torch.dtype, device: torch.device
                 ) -> KVCache:
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        # Zero-filled: padded decode rows read unwritten slots (masked, but a NaN there
        # would still poison the weighted sum).
        data = zeroed(shape, storage, device)
        scales = zeroed(shape[:-1], SCALE_DTYPE, device) if is_quantized(storage) else None
        return cls(data, scales, compute_dtype)

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the block pool, scales included."""
        scales = self.scales.nbytes if self.scales is not None else 0
        return self.data.nbytes + scales

    @property
    def block_size(self) -> int:
        return self.data.shape[2]

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store K/V [T, KVH, D] of T tokens at their slots (block_id * block_size + offset)."""
        num_slots = self.data.shape[1] * self.data.shape[2]
        flat = self.data.view(2, num_slots, *self.data.shape[3:])
        if self.scales is None:
            flat[0].index_copy_(0, slot_mapping, k)
            flat[1].index_copy_(0, slot_mapping, v)
            return
        flat_scales = self.scales.view(2, num_slots, self.scales.shape[3])
        # Copied as raw bytes: index_copy_ has no CPU kernel for float8.
        flat_bytes = flat.view(torch.uint8)
        for index, x in enumerate((k, v)):
            codes, scale = quantize(x, self.data.dtype)
            flat_bytes[index].index_copy_(0, slot_mapping, codes.view(torch.uint8))
            flat_scales[index].index_copy_(0, slot_mapping, scale)

    def gather(self, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks as [..., num_blocks * block_size, KVH, D].

        A quantized cache gathers the 1-byte codes and their scales (a quarter of the
        fp32 bytes moved) and dequantises only what was gathered.
        """
        # index_select on the block dimension copies whole blocks (contiguous rows);
        # advanced indexing with a 2-D table measured ~2x slower here.
        flat_table = block_table.reshape(-1)
        keys = self.data[0].index_select(0, flat_table)
        values = self.data[1].index_select(0, flat_table)
        if self.scales is not None:
            keys = dequantize(keys, self.scales[0].index_select(0, flat_table),
                              self.compute_dtype)
            values = dequantize(values, self.scales[1].index_select(0, flat_table),
                                self.compute_dtype)
        out_shape = (*block_table.shape[:-1], -1, *self.data.shape[3:])
        return keys.reshape(out_shape), values.reshape(out_shape)
