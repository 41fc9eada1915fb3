"""Every quantized product equals the product with the dequantized float weight (float64
oracle) to float32 rounding, at 1, 7 and 64 rows: the kernels are exact, whatever
quantization lost."""

from __future__ import annotations

import pytest
import torch

from tokenmill.quant import kernels
from tokenmill.quant.formats import dequantize, quantize_int4_rtn, quantize_int8
from tokenmill.quant.hqq import quantize_int4_hqq
from tokenmill.quant.kernels import KernelTable, native_library
from tokenmill.quant.packing import pack

SCHEMES = {
    "int8": lambda w: quantize_int8(w),
    "int8-g32": lambda w: quantize_int8(w, 32),
    "int4-rtn-g32": lambda w: quantize_int4_rtn(w, 32),
    "int4-rtn-g128": lambda w: quantize_int4_rtn(w, 128),
    "int4-hqq-g64": lambda w: quantize_int4_hqq(w, 64),
}


def oracle(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().t()
    return out + bias.double() if bias is not None else out


def assert_exact_to_float32(out: torch.Tensor, expected: torch.Tensor, in_features: int):
    # float32 sums of in_features products: a few ulps of the largest partial sums.
    tolerance = 4e-7 * in_features ** 0.5 * expected.abs().max().item()
    assert out.dtype == torch.float32
    assert (out.double() - expected).abs().max().item() <= tolerance


@pytest.fixture(scope="module")
def native():
    if native_library() is None:
        pytest.skip("the native kernels could not be compiled here")
    return kernels.native_linear


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("rows", [1, 7, 13, 64])
@pytest.mark.parametrize("kernel", ["native", "dequantize"])
def test_quantized_product_equals_the_dequantized_reference(native, scheme, rows, kernel):
    generator = torch.Generator().manual_seed(rows)
    # 100 outputs: the last 16-lane block is partial; 256 inputs: several groups.
    weight = 0.05 * torch.randn(100, 256, generator=generator)
    bias = torch.randn(100, generator=generator)
    quantized = SCHEMES[scheme](weight)
    packed = pack(quantized)
    x = torch.randn(rows, 256, generator=generator)
    table = KernelTable.uniform(kernel)
    for b in (None, bias):
        out = table.linear(x, packed, b)
        assert_exact_to_float32(out, oracle(x, dequantize(quantized), b), 256)


def test_leading_dimensions_are_kept(native):
    weight = pack(quantize_int4_rtn(torch.randn(48, 64), 32))
    x = torch.randn(2, 3, 64)
    out = KernelTable.uniform("native").linear(x, weight, None)
    assert out.shape == (2, 3, 48)
    torch.testing.assert_close(out[1, 2], KernelTable.uniform("native").linear(
        x[1, 2:3], weight, None)[0])


def test_a_kernel_table_serves_each_row_class_with_its_kernel():
    table = KernelTable({1: "native", 8: "dequantize", 32: "native", 256: "dequantize"})
    assert [table.kernel_for(n) for n in (1, 2, 8, 9, 32, 33, 256, 5000)] == [
        "native", "dequantize", "dequantize", "native", "native", "dequantize", "dequantize",
        "dequantize"]
    with pytest.raises(ValueError, match="kernel table"):
        KernelTable({1: "native"})
    with pytest.raises(ValueError, match="kernel table"):
        KernelTable.uniform("bf16")


def test_measured_table_names_a_kernel_per_class(native, tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "CACHE", tmp_path)
    (tmp_path / "kernels").mkdir()
    table = kernels.kernel_table(8, threads=1)
    assert set(table.choices) == set(kernels.ROW_CLASSES)
    # Cached: read back, not measured again.
    monkeypatch.setattr(kernels, "measure_kernel_table", None)
    assert kernels.kernel_table(8, threads=1).choices == table.choices
