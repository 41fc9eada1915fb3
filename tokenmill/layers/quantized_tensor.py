"""A checkpoint weight saved already quantized by `tokenmill quantize` (a pre-quantized
checkpoint, model/prequantized.py): the codes, scales and offsets of quant/formats.py
in the file's row-major layout, and AWQ's activation scale when the method has one.

    codes        int8 [out, in]       (8 bits: w = code * scale)
                 uint8 [out, in / 2]  (4 bits, two codes a byte: column 2c in the low
                                       nibble, 2c + 1 in the high; w = code * scale + offset)
    scales       float32 [out, in / group_size]
    offsets      float32 [out, in / group_size]   (4 bits only)
    input_scale  float32 [in]                      (AWQ: y = (x * input_scale) W^T)

Every quantity but the input scale belongs to one output row, so a fused layer's parts
(q, k, v) are its rows, as for a float weight. A linear method that keeps the form takes
it as it is (`LinearMethod.takes_blocks`); any other is given `dequantize()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [out, in] -> [out, in / 2], two a byte."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[out, in / 2] -> uint8 codes 0..15 [out, in] (the inverse of pack_nibbles)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


@dataclass(frozen=True)
class SavedQuantTensor:
    bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        rows, columns = self.shape
        expected = torch.int8 if self.bits == 8 else torch.uint8
        if self.bits not in (4, 8) or self.codes.dtype != expected:
            raise ValueError(f"saved codes: {self.bits}-bit codes must be {expected}, "
                             f"got {self.codes.dtype}")
        groups = self.scales.shape[-1] if self.scales.dim() == 2 else 0
        if (self.scales.shape[0] != rows or groups == 0 or columns % groups
                or (self.bits == 4) != (self.offsets is not None)
                or (self.offsets is not None and self.offsets.shape != self.scales.shape)
                or (self.input_scale is not None and self.input_scale.shape != (columns,))):
            raise ValueError(f"saved scales {tuple(self.scales.shape)}, offsets and input "
                             f"scale do not fit {self.bits}-bit codes of shape {self.shape}")

    @property
    def shape(self) -> tuple[int, int]:
        """The float weight's [out, in]."""
        rows, stored = self.codes.shape
        return rows, stored * (2 if self.bits == 4 else 1)

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    def unpacked_codes(self) -> torch.Tensor:
        """[out, in]: int8 codes, or uint8 0..15."""
        return unpack_nibbles(self.codes) if self.bits == 4 else self.codes

    def rows(self, index: torch.Tensor | slice) -> SavedQuantTensor:
        offsets = self.offsets[index] if self.offsets is not None else None
        return SavedQuantTensor(self.bits, self.codes[index], self.scales[index], offsets,
                                self.input_scale)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] the codes stand for (AWQ's scale folded in)."""
        rows, columns = self.shape
        values = self.unpacked_codes().float().reshape(rows, -1, self.group_size)
        values = values * self.scales[..., None]
        if self.offsets is not None:
            values = values + self.offsets[..., None]
        weight = values.reshape(rows, columns)
        return weight * self.input_scale if self.input_scale is not None else weight
