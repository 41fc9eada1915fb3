"""AWQ (activation-aware weight quantization, Lin et al. 2023), written for this package.

A weight's input columns that meet large activations matter most to the output, and
round-to-nearest treats every column alike. AWQ scales column k up by s_k before
quantizing, so it gets finer steps relative to its size, and scales the activation
down by the same s_k, which leaves the product unchanged but for the rounding:

    s = mean|x_k|^alpha (normalised to a geometric mean of 1),  W' = Q(W diag(s))
    y = (x / s) W'^T      alpha in [0, 1] per layer, minimising ||X W^T - (X / s) W'^T||^2

on calibration activations X recorded while the float model runs a calibration text.
Here 1/s is not folded into the previous layer (a norm, or the rows of another
projection, which would tie the method to each model's structure): the method
multiplies the activation by it before the quantized product, an elementwise product
of one row per token, so every Linear (fused, expert, LM head) is treated alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tokenmill.layers.linear import Linear
from tokenmill.quant.formats import QuantizedWeight, dequantize, quantize_int4_rtn

ALPHAS = [i / 10 for i in range(11)]
# Rows of activations kept per layer for the search (spread over the calibration text).
SAMPLE_ROWS = 256
_MIN_MEAN = 1e-5


class InputStats:
    """Per input channel: the sum of |x| and the count; and a sample of input rows."""

    def __init__(self, in_features: int) -> None:
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64)
        self.count = 0
        self.rows: list[torch.Tensor] = []
        self.kept = 0

    def add(self, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, x.shape[-1]).float()
        self.abs_sum += rows.abs().sum(dim=0, dtype=torch.float64)
        self.count += rows.shape[0]
        if self.kept < SAMPLE_ROWS:
            # Every fourth row: spread over more of the text than the first few rows.
            take = rows[::4][:SAMPLE_ROWS - self.kept].clone()
            self.rows.append(take)
            self.kept += take.shape[0]

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(self.count, 1)).float()

    @property
    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows) if self.rows else torch.empty(0, self.abs_sum.shape[0])


@contextmanager
def record_inputs(layers: dict[str, Linear]) -> Iterator[dict[str, InputStats]]:
    """While inside, every call of these layers adds its input to the layer's stats."""
    stats = {name: InputStats(layer.in_features) for name, layer in layers.items()}
    handles = [layer.register_forward_pre_hook(
                   lambda _module, args, s=stats[name]: s.add(args[0]))
               for name, layer in layers.items()]
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()


def input_scales(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    scales = mean_abs.clamp_min(_MIN_MEAN).pow(alpha)
    return scales / (scales.max() * scales.min()).sqrt()


def quantize_awq(weight: torch.Tensor, group_size: int, stats: InputStats
                 ) -> tuple[QuantizedWeight, torch.Tensor]:
    """(codes of W diag(s), 1/s) for the alpha whose output error on the sampled rows is
    least. alpha = 0 is round-to-nearest itself, so the search never ends worse than
    round-to-nearest on those rows. Without samples (an expert no calibration token
    reached) round-to-nearest is kept."""
    weight = weight.float()
    sample = stats.sample
    best = (quantize_int4_rtn(weight, group_size), torch.ones(weight.shape[1]))
    if sample.shape[0] == 0:
        return best
    reference = sample @ weight.t()
    best_error = float("inf")
    for alpha in ALPHAS:
        scales = input_scales(stats.mean_abs, alpha)
        quantized = quantize_int4_rtn(weight * scales, group_size)
        inverse = 1.0 / scales
        error = ((sample * inverse) @ dequantize(quantized).t() - reference).pow(2).sum().item()
        if error < best_error:
            best, best_error = (quantized, inverse), error
    return best
