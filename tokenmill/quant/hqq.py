"""HQQ (half-quadratic quantization, mobiusml/hqq): calibration-free 4-bit zero points.

Round-to-nearest puts each group's grid on its min and max, so one outlier widens the
steps for every other weight. HQQ keeps the scale s (codes per weight unit) and moves
the zero point z to minimise the l_p error (p = 0.7 < 1: a few large errors cost less
than many small ones, so outliers are given up rather than chased) by half-quadratic
splitting: an auxiliary error variable e absorbs the sparse large errors through a
generalised soft-threshold, and z then has a closed form, the mean over the group:

    q = clamp(round(W s + z), 0, 15);   W_r = (q - z) / s
    e = shrink_p(W - W_r, beta)         sign(x) relu(|x| - |x|^(p-1) / beta)
    z = mean(q - (W - e) s)             per group
    beta *= kappa

Each group keeps the zero point with the lowest mean |W - W_r| seen, starting from
round-to-nearest's own, so no group ends worse than round-to-nearest by that measure.
"""

from __future__ import annotations

import torch

from tokenmill.quant.formats import (
    INT4_MAX,
    QuantizedWeight,
    grouped,
    minmax_scale_offset,
)

P_NORM = 0.7
BETA = 10.0
KAPPA = 1.01
ITERATIONS = 20
# Rows optimised at once: bounds the working memory (a few copies of the chunk).
CHUNK_ROWS = 4096


def shrink(x: torch.Tensor, beta: float, p: float = P_NORM) -> torch.Tensor:
    """The l_p proximal step: large entries pass (less |x|^(p-1) / beta), small ones go to 0."""
    magnitude = x.abs()
    return torch.sign(x) * torch.relu(magnitude - magnitude.pow(p - 1) / beta)


def optimise_zero(groups: torch.Tensor, inv_scale: torch.Tensor, zero: torch.Tensor,
                  iterations: int = ITERATIONS) -> torch.Tensor:
    """The zero point per group [rows, G] of grouped weights [rows, G, group]."""
    inv = inv_scale[..., None]
    best_zero = zero.clone()
    best_error = torch.full_like(zero, float("inf"))
    beta = BETA
    for _ in range(iterations):
        codes = (groups * inv + zero[..., None]).round_().clamp_(0, INT4_MAX)
        residual = groups - (codes - zero[..., None]) / inv
        error = residual.abs().mean(dim=-1)
        improved = error < best_error
        best_error = torch.where(improved, error, best_error)
        best_zero = torch.where(improved, zero, best_zero)
        if not improved.any():
            break
        sparse = shrink(residual, beta)
        zero = (codes - (groups - sparse) * inv).mean(dim=-1)
        beta *= KAPPA
    return best_zero


def quantize_int4_hqq(weight: torch.Tensor, group_size: int,
                      iterations: int = ITERATIONS) -> QuantizedWeight:
    """Asymmetric 4-bit codes with round-to-nearest's scales and HQQ's zero points."""
    out_features = weight.shape[0]
    codes = torch.empty(weight.shape, dtype=torch.uint8)
    scales = torch.empty(out_features, weight.shape[1] // group_size)
    offsets = torch.empty_like(scales)
    for start in range(0, out_features, CHUNK_ROWS):
        rows = slice(start, min(start + CHUNK_ROWS, out_features))
        groups = grouped(weight[rows], group_size)
        scale, low = minmax_scale_offset(groups)
        inv_scale = 1.0 / scale
        zero = optimise_zero(groups, inv_scale, -low * inv_scale, iterations)
        chunk_codes = (groups * inv_scale[..., None] + zero[..., None]).round().clamp(0, INT4_MAX)
        codes[rows] = chunk_codes.to(torch.uint8).reshape(codes[rows].shape)
        scales[rows] = scale
        offsets[rows] = -zero * scale
    return QuantizedWeight(4, group_size, codes, scales, offsets)
