"""Quantize/dequantize of K/V rows against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kv import KVCache, dequantize, quantize
from tokenmill.kv.quant import codes_to


def roundtrip(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale = quantize(x.float(), dtype)
    return dequantize(codes, scale, torch.float64), scale.double()


def rows(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 4, 32, generator=gen, dtype=torch.float64)
    # Rows of very different magnitudes, and a few outlier channels.
    x *= torch.logspace(-3, 3, 64, dtype=torch.float64)[:, None, None]
    x[:, :, 5] *= 20
    return x


@pytest.mark.parametrize("seed", range(3))
def test_int8_error_is_at_most_half_a_step(seed):
    x = rows(seed)
    x_hat, scale = roundtrip(x, torch.int8)
    # absmax / 127 per row; rounding to the nearest code errs by at most half of it
    # (the 1e-6 allows for the float32 division before rounding).
    assert torch.allclose(scale, x.abs().amax(-1) / 127, rtol=1e-6)
    assert ((x_hat - x).abs() <= scale[..., None] * (0.5 + 1e-6)).all()


@pytest.mark.parametrize("seed", range(3))
def test_fp8_error_is_within_e4m3_precision(seed):
    x = rows(seed)
    x_hat, scale = roundtrip(x, torch.float8_e4m3fn)
    assert torch.allclose(scale, x.abs().amax(-1) / 448, rtol=1e-6)
    # e4m3: 3 mantissa bits, so relative error <= 2^-4 for normal codes; below the
    # smallest normal (2^-6) the spacing is 2^-9, so absolute error <= 2^-10 steps.
    bound = torch.maximum(x.abs() * 2**-4, scale[..., None] * 2**-10) * (1 + 1e-5)
    assert ((x_hat - x).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_table_lookup_equals_the_cast_for_every_byte(dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    looked_up, cast = codes_to(codes.reshape(16, 16), dtype), codes.to(dtype).reshape(16, 16)
    assert torch.equal(looked_up.isnan(), cast.isnan())
    assert torch.equal(looked_up.nan_to_num(), cast.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_row_maximum_is_exact_to_float32(dtype):
    x = rows(7)
    x_hat, _ = roundtrip(x, dtype)
    top = x.abs().argmax(-1, keepdim=True)
    assert torch.allclose(x_hat.gather(-1, top), x.gather(-1, top), rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_huge_and_infinite_activations_saturate_without_nan(dtype):
    x = torch.randn(8, 2, 16) * 1e30
    x[0, 0, 3] = float("inf")
    x[1, 1, 0] = float("-inf")
    x[2] = 0.0  # an all-zero row must not divide by zero
    x[3, 0] = 3e38
    codes, scale = quantize(x, dtype)
    x_hat = dequantize(codes, scale, torch.float32)
    assert torch.isfinite(codes.float()).all() and torch.isfinite(scale).all()
    assert torch.isfinite(x_hat).all()
    assert (x_hat[2] == 0).all()
    assert x_hat[0, 0, 3] > 0 and x_hat[1, 1, 0] < 0


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_cache_write_then_gather_returns_dequantised_tokens(dtype):
    cache = KVCache.allocate(num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8,
                             storage=dtype, compute_dtype=torch.float32,
                             device=torch.device("cpu"))
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([20, 1, 13, 2, 7])
    cache.write(k, v, slots)
    table = torch.tensor([[0, 3, 5, 1]])  # gathered positions 4*i + offset
    keys, values = cache.gather(table)
    position = {0: 0, 12: 1, 20: 2, 4: 3}  # block -> first gathered position of it
    for row, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, 4)
        pos = position[block * 4] * 4 + offset
        for got, want in ((keys[0, pos], k[row]), (values[0, pos], v[row])):
            codes, scale = quantize(want, dtype)
            assert torch.equal(got, dequantize(codes, scale, torch.float32))


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16, torch.int8,
                                     torch.float8_e4m3fn])
def test_a_new_pool_reads_zero_everywhere_and_takes_writes(storage):
    """The CPU pool's memory comes from calloc'd pages (no zeroing pass at start-up):
    it must still read as zeros in every storage type, scales included, and be writable."""
    cache = KVCache.allocate(9, 4, 2, 8, storage, torch.float32, torch.device("cpu"))
    assert cache.data.shape == (2, 9, 4, 2, 8) and cache.data.dtype == storage
    assert not cache.data.float().any() and cache.data.is_contiguous()
    if cache.scales is not None:
        assert cache.scales.shape == (2, 9, 4, 2) and not cache.scales.any()
    cache.data[1, 8] = torch.ones(4, 2, 8).to(storage)
    assert cache.data.float().sum() == 4 * 2 * 8 and not cache.data[0].float().any()
