"""A checkpoint tensor still in a block-quantized file format (GGUF's Q8_0, Q4_0, Q4_K,
...): rows of raw block bytes. A linear method that keeps the format decodes the blocks
itself (`LinearMethod.takes_blocks`); every other one is given `dequantize()`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# (format, block bytes [rows, bytes per row], float shape) -> float32 [rows, columns]
BlockDecoder = Callable[[str, torch.Tensor, tuple[int, int]], torch.Tensor]


@dataclass(frozen=True)
class BlockTensor:
    format: str
    data: torch.Tensor  # uint8 [rows, bytes per row]
    shape: tuple[int, int]  # the float tensor's [rows, columns]
    decoder: BlockDecoder

    def dequantize(self) -> torch.Tensor:
        return self.decoder(self.format, self.data, self.shape)

    def rows(self, index: torch.Tensor) -> BlockTensor:
        """The rows `index` (blocks run along a row, so any row order is a block order)."""
        return BlockTensor(self.format, self.data[index], (len(index), self.shape[1]),
                           self.decoder)
