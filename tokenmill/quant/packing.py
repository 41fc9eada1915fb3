"""The kernel layout of a quantized weight (csrc/qlinear.cpp reads it).

Output rows are taken in blocks of LANES = 16 (the last block padded with zero codes
and zero scales); within a block, input column k holds the 16 rows' codes side by
side, so a product streams each block once and a 16-lane vector needs no shuffle:

    int8  codes  [blocks, in, 16]        int8
    int4  codes  [blocks, in / 2, 16]    uint8: column 2c in the low nibble, 2c+1 high
          scales, offsets [blocks, in / group_size, 16] float32
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.quant.formats import QuantizedWeight

LANES = 16


@dataclass
class PackedWeight:
    bits: int
    group_size: int
    out_features: int
    in_features: int
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        tensors = (self.codes, self.scales, self.offsets)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def num_blocks(out_features: int) -> int:
    return -(-out_features // LANES)


def packed_bytes(bits: int, out_features: int, in_features: int, group_size: int) -> int:
    """Bytes `pack` produces for a weight of this shape (for memory planning)."""
    rows = num_blocks(out_features) * LANES
    groups = in_features // group_size
    per_row = in_features * bits // 8 + groups * 4 * (2 if bits == 4 else 1)
    return rows * per_row


def _blocked(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """[out, C] -> [blocks, C, 16], zero rows appended up to whole blocks."""
    t = F.pad(t, (0, 0, 0, blocks * LANES - t.shape[0]))
    return t.reshape(blocks, LANES, t.shape[1]).transpose(1, 2).contiguous()


def pack(weight: QuantizedWeight) -> PackedWeight:
    if weight.bits == 4 and weight.in_features % 2:
        raise ValueError("4-bit weights need an even number of input columns")
    blocks = num_blocks(weight.out_features)
    codes = weight.codes
    if weight.bits == 4:
        codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    offsets = _blocked(weight.offsets.float(), blocks) if weight.offsets is not None else None
    return PackedWeight(weight.bits, weight.group_size, weight.out_features,
                        weight.in_features, _blocked(codes, blocks),
                        _blocked(weight.scales.float(), blocks), offsets)


def unpack_rows(packed: PackedWeight, rows: torch.Tensor) -> QuantizedWeight:
    """The codes and scales of output rows `rows` (e.g. token ids of a tied embedding)."""
    block, lane = rows // LANES, rows % LANES
    codes = packed.codes[block, :, lane]  # [R, in] or [R, in / 2]
    if packed.bits == 4:
        codes = torch.stack((codes & 15, codes >> 4), dim=-1).reshape(len(rows), -1)
    offsets = packed.offsets[block, :, lane] if packed.offsets is not None else None
    return QuantizedWeight(packed.bits, packed.group_size, codes,
                           packed.scales[block, :, lane], offsets)


def unpack(packed: PackedWeight) -> QuantizedWeight:
    return unpack_rows(packed, torch.arange(packed.out_features))
