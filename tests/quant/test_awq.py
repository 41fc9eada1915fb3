"""AWQ: on activations with outlier channels, activation-aware scales cut the output
error of 4-bit weights below round-to-nearest's, on rows the search never saw."""

from __future__ import annotations

import torch

from tokenmill.layers.linear import Linear
from tokenmill.quant.awq import InputStats, input_scales, quantize_awq, record_inputs
from tokenmill.quant.formats import dequantize, quantize_int4_rtn


def activations(rows: int, seed: int) -> torch.Tensor:
    """Inputs whose channels differ in scale by up to 50x, as a trained model's do."""
    generator = torch.Generator().manual_seed(seed)
    channel_scale = torch.ones(256)
    channel_scale[torch.randperm(256, generator=torch.Generator().manual_seed(7))[:8]] = 50.0
    channel_scale[:64] = 5.0
    return torch.randn(rows, 256, generator=generator) * channel_scale


def output_error(x: torch.Tensor, weight: torch.Tensor, effective: torch.Tensor) -> float:
    return (x @ effective.t() - x @ weight.t()).pow(2).sum().item()


def test_awq_output_error_is_below_round_to_nearest_on_unseen_rows():
    weight = 0.02 * torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    stats = InputStats(256)
    stats.add(activations(1024, seed=1))
    quantized, inverse = quantize_awq(weight, 64, stats)
    held_out = activations(512, seed=2)
    awq = output_error(held_out, weight, dequantize(quantized) * inverse)
    rtn = output_error(held_out, weight, dequantize(quantize_int4_rtn(weight, 64)))
    assert awq < 0.8 * rtn
    assert not torch.equal(inverse, torch.ones(256))  # it did scale channels


def test_without_calibration_rows_awq_is_round_to_nearest():
    weight = torch.randn(32, 64)
    quantized, inverse = quantize_awq(weight, 32, InputStats(64))
    assert torch.equal(inverse, torch.ones(64))
    assert torch.equal(quantized.codes, quantize_int4_rtn(weight, 32).codes)


def test_scales_at_alpha_zero_are_one_and_normalised():
    mean = torch.tensor([0.1, 1.0, 10.0])
    assert torch.equal(input_scales(mean, 0.0), torch.ones(3))
    scales = input_scales(mean, 1.0)
    assert torch.isclose(scales.max() * scales.min(), torch.tensor(1.0))


def test_recorded_inputs_are_every_call_of_the_layer():
    layer = Linear(16, 4)
    layer.weight.data.normal_()
    x = torch.randn(2, 10, 16)
    with record_inputs({"layer": layer}) as stats:
        layer(x[0])
        layer(x[1])
    layer(torch.randn(3, 16))  # after the context: not recorded
    recorded = stats["layer"]
    assert recorded.count == 20
    torch.testing.assert_close(recorded.mean_abs, x.reshape(-1, 16).abs().mean(0))
    assert recorded.sample.shape == (6, 16)  # every fourth row of each call
