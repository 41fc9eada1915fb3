"""Quantize -> dequantize on random weights: each method's error within its bound, HQQ
below round-to-nearest, the kernel layout a lossless rearrangement."""

from __future__ import annotations

import pytest
import torch

from tokenmill.quant.formats import dequantize, quantize_int4_rtn, quantize_int8
from tokenmill.quant.hqq import quantize_int4_hqq
from tokenmill.quant.packing import pack, packed_bytes, unpack, unpack_rows


def random_weight(out_features: int = 96, in_features: int = 256, seed: int = 0,
                  heavy_tailed: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if heavy_tailed:  # trained weights have outliers: Student's t with 3 degrees
        normal = torch.randn(out_features, in_features, generator=generator)
        chi2 = torch.randn(3, out_features, in_features, generator=generator).pow(2).sum(0)
        return 0.02 * normal / (chi2 / 3).sqrt()
    return 0.02 * torch.randn(out_features, in_features, generator=generator)


def per_element_scale(quantized) -> torch.Tensor:
    return quantized.scales.repeat_interleave(quantized.group_size, dim=1)


@pytest.mark.parametrize("group_size", [None, 32, 128])
def test_int8_error_is_at_most_half_a_step(group_size):
    weight = random_weight(heavy_tailed=True)
    quantized = quantize_int8(weight, group_size)
    error = (dequantize(quantized) - weight).abs()
    assert quantized.codes.dtype == torch.int8 and quantized.codes.abs().max() <= 127
    assert (error <= per_element_scale(quantized) / 2 * (1 + 1e-5)).all()
    # The largest weight of every group lands on the edge of the code range.
    assert (quantized.codes.abs().reshape(96, -1, quantized.group_size).amax(-1) == 127).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_to_nearest_error_is_at_most_half_a_step(group_size):
    weight = random_weight(heavy_tailed=True)
    quantized = quantize_int4_rtn(weight, group_size)
    error = (dequantize(quantized) - weight).abs()
    assert 0 <= quantized.codes.min() and quantized.codes.max() <= 15
    assert (error <= per_element_scale(quantized) / 2 + 1e-7).all()


@pytest.mark.parametrize("quantize", [lambda w: quantize_int8(w), lambda w: quantize_int8(w, 32),
                                      lambda w: quantize_int4_rtn(w, 64)])
def test_requantizing_a_dequantized_weight_reproduces_it(quantize):
    once = dequantize(quantize(random_weight(seed=3)))
    twice = dequantize(quantize(once))
    torch.testing.assert_close(twice, once, rtol=0, atol=1e-7)


def test_hqq_error_is_below_round_to_nearest_on_most_layers():
    """Mean |W - W_hat| (the measure the HQQ paper and TECHNIQUES.md use), per layer."""
    wins = 0
    layers = 12
    for seed in range(layers):
        weight = random_weight(64, 256, seed=seed, heavy_tailed=True)
        rtn = (dequantize(quantize_int4_rtn(weight, 64)) - weight).abs().mean()
        hqq = (dequantize(quantize_int4_hqq(weight, 64)) - weight).abs().mean()
        wins += bool(hqq < rtn * 0.99)
    assert wins >= layers - 1


def test_hqq_codes_and_grid_stay_in_range():
    weight = random_weight(heavy_tailed=True)
    quantized = quantize_int4_hqq(weight, 32)
    assert quantized.codes.dtype == torch.uint8 and quantized.codes.max() <= 15
    assert torch.equal(quantized.scales, quantize_int4_rtn(weight, 32).scales)
    assert torch.isfinite(dequantize(quantized)).all()


@pytest.mark.parametrize("bits, group_size", [(8, None), (8, 32), (4, 32), (4, 128)])
@pytest.mark.parametrize("out_features", [16, 100])
def test_packing_is_lossless_and_sized_as_planned(bits, group_size, out_features):
    weight = random_weight(out_features, 256, seed=1)
    quantized = quantize_int8(weight, group_size) if bits == 8 else quantize_int4_rtn(
        weight, group_size)
    packed = pack(quantized)
    back = unpack(packed)
    assert torch.equal(back.codes, quantized.codes)
    assert torch.equal(back.scales, quantized.scales)
    if bits == 4:
        assert torch.equal(back.offsets, quantized.offsets)
    rows = torch.tensor([out_features - 1, 0, 17 % out_features])
    torch.testing.assert_close(dequantize(unpack_rows(packed, rows)),
                               dequantize(quantized)[rows], rtol=0, atol=0)
    assert packed.nbytes == packed_bytes(bits, out_features, 256, quantized.group_size)
