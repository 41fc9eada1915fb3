"""What a quantized weight stores, and round-to-nearest quantization into it.

A weight W [out, in] is cut along its input columns into groups of `group_size`
(the whole row for per-channel scales); every (output row, group) has its own scale,
and for 4-bit codes its own offset:

    int8  codes in [-127, 127], symmetric:   w = code * scale
    int4  codes in [0, 15], asymmetric:      w = code * scale + offset

The offset is the zero point in weight units (offset = -zero * scale), so one form
holds round-to-nearest min/max, HQQ's optimised zero points and GGUF's Q4_0 / Q4_K
blocks alike. Scales and offsets are float32: 0.5 bit per weight at group 128
(offsets included), 2 bits at group 32, and no subnormal float16 scales for tiny
weights. `dequantize` is the reference every kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127
INT4_MAX = 15
# Keeps an all-zero group finite (its scale becomes tiny rather than 0).
_MIN_SCALE = 1e-12


@dataclass
class QuantizedWeight:
    """A weight's codes [out, in] (int8, or uint8 holding 0..15 for 4 bits) and its
    float32 scales (and offsets, 4-bit only) [out, in / group_size]."""

    bits: int
    group_size: int
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    def rows(self, rows: slice | torch.Tensor) -> QuantizedWeight:
        offsets = self.offsets[rows] if self.offsets is not None else None
        return QuantizedWeight(self.bits, self.group_size, self.codes[rows],
                               self.scales[rows], offsets)


def check_group_size(in_features: int, group_size: int) -> None:
    if group_size < 1 or in_features % group_size:
        raise ValueError(f"quantization_group_size: {group_size} does not divide the "
                         f"layer's {in_features} input columns")


def grouped(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """[out, in] -> [out, in / group_size, group_size] (float32)."""
    check_group_size(weight.shape[1], group_size)
    return weight.float().reshape(weight.shape[0], -1, group_size)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric round-to-nearest: scale = absmax / 127 per output row (per group of
    `group_size` input columns when given)."""
    group_size = group_size or weight.shape[1]
    groups = grouped(weight, group_size)
    scales = (groups.abs().amax(dim=-1) / INT8_MAX).clamp_min(_MIN_SCALE)
    codes = (groups / scales[..., None]).round().clamp(-INT8_MAX, INT8_MAX)
    return QuantizedWeight(8, group_size, codes.to(torch.int8).reshape(weight.shape), scales)


def minmax_scale_offset(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The round-to-nearest asymmetric grid of each group: [min, max] in 15 steps."""
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    return ((high - low) / INT4_MAX).clamp_min(_MIN_SCALE), low


def int4_codes(groups: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
               ) -> torch.Tensor:
    """Nearest codes 0..15 of grouped weights [out, G, group] on a given grid."""
    return ((groups - offsets[..., None]) / scales[..., None]).round().clamp(0, INT4_MAX)


def quantize_int4_rtn(weight: torch.Tensor, group_size: int) -> QuantizedWeight:
    """Asymmetric round-to-nearest on each group's min/max grid."""
    groups = grouped(weight, group_size)
    scales, offsets = minmax_scale_offset(groups)
    codes = int4_codes(groups, scales, offsets)
    return QuantizedWeight(4, group_size, codes.to(torch.uint8).reshape(weight.shape),
                           scales, offsets)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight [out, in] the codes stand for."""
    out, in_features = weight.codes.shape
    codes = weight.codes.float().reshape(out, -1, weight.group_size)
    values = codes * weight.scales[..., None]
    if weight.offsets is not None:
        values = values + weight.offsets[..., None]
    return values.reshape(out, in_features)
