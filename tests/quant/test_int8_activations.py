"""int8 activations (`--quantization-activations int8`, W8A8 / W4A8 on AVX-512 VNNI):
the kernel equals, to float32 rounding, the float64 product of the dequantized weight
with the activations rounded as `quantize_activations` rounds them (a plain-torch
reference); a model runs exactly as the dequantized model whose every quantized layer
rounds its input that way; and the knob refuses what it cannot do."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.engine_run import run_staggered
from tests.quant.test_kernels import SCHEMES, assert_exact_to_float32, oracle
from tests.quant.test_quantized_model import (
    GREEDY,
    PROMPTS,
    dequantized_reference,
    linear_layers,
    run,
)
from tokenmill.config import QuantConfig
from tokenmill.quant import kernels
from tokenmill.quant.formats import dequantize
from tokenmill.quant.methods import QuantizedLinearMethod
from tokenmill.quant.packing import pack

needs_vnni = pytest.mark.skipif(kernels.a8_library() is None,
                                reason="no AVX-512 VNNI + VBMI kernels on this CPU")


def test_activation_rounding_stays_within_half_a_step_per_chunk():
    x = torch.randn(5, 96) * torch.logspace(-3, 2, 96)
    rounded = kernels.quantize_activations(x)
    chunks, error = x.reshape(-1, 32), (rounded - x).reshape(-1, 32)
    step = chunks.abs().amax(dim=1, keepdim=True) / 127
    assert (error.abs() <= step / 2 * (1 + 1e-5)).all()
    assert torch.equal(kernels.quantize_activations(torch.zeros(2, 32)), torch.zeros(2, 32))


@needs_vnni
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("rows", [1, 7, 13, 64])
def test_int8_activation_product_equals_its_reference(scheme, rows):
    generator = torch.Generator().manual_seed(rows)
    weight = 0.05 * torch.randn(100, 256, generator=generator)  # a partial last block
    bias = torch.randn(100, generator=generator)
    quantized = SCHEMES[scheme](weight)
    packed = pack(quantized)
    x = torch.randn(rows, 256, generator=generator)
    table = kernels.KernelTable.uniform("a8")
    for b in (None, bias):
        out = table.linear(x, packed, b)
        expected = oracle(kernels.quantize_activations(x), dequantize(quantized), b)
        assert_exact_to_float32(out, expected, 256)
        # ... and not the float32-activation product: the rounding is real.
        unrounded = oracle(x, dequantize(quantized), b)
        assert (out.double() - unrounded).abs().max() > 1e-4 * unrounded.abs().max()


@needs_vnni
def test_widths_not_in_multiples_of_32_take_the_float_kernel():
    weight = pack(SCHEMES["int8"](torch.randn(40, 48)))  # 48 input columns
    x = torch.randn(3, 48)
    out = kernels.KernelTable.uniform("a8").linear(x, weight, None)
    torch.testing.assert_close(out, kernels.native_linear(x, weight, None), rtol=0, atol=0)


CASES = [
    ("llama", {"quantization": "int8"}),
    ("llama_mqa_tied", {"quantization": "int4", "quantization_group_size": 32}),
    ("mixtral", {"quantization": "int4", "quantization_group_size": 64,
                 "quantization_method": "hqq"}),
]


@needs_vnni
@pytest.mark.parametrize("family, options", CASES)
def test_model_generates_what_rounded_inputs_to_dequantized_weights_generate(
        model_factory, family, options):
    model_dir = model_factory(family)
    tokens, engine = run(model_dir, quantization_activations="int8", **options)
    layers = linear_layers(engine)
    assert all(m.method.scheme.activations == "int8" for m in layers.values()
               if isinstance(m.method, QuantizedLinearMethod))
    reference = dequantized_reference(model_dir, engine)
    for name, layer in linear_layers(reference).items():
        if isinstance(layers[name].method, QuantizedLinearMethod):
            layer.forward = (lambda x, apply=layer.forward, **options:
                             apply(kernels.quantize_activations(x), **options))
    expected = run_staggered(reference, PROMPTS, GREEDY, arrivals=[0, 1, 1, 4])
    assert tokens == expected


def test_the_knob_names_its_field(model_factory):
    with pytest.raises(ValueError, match="quantization_activations"):
        QuantConfig(quantization="int8", quantization_activations="int4")
    with pytest.raises(ValueError, match="quantization_activations: int8 activations need"):
        run(model_factory("llama"), quantization_activations="int8")


def test_a_cpu_without_vnni_keeps_float_activations(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "a8_library", lambda: None)
    with caplog.at_level(logging.WARNING, logger="tokenmill.quant.kernels"):
        table = kernels.kernel_table(8, activations="int8")
    assert "a8" not in table.choices.values()
    assert "activations stay float32" in caplog.text
