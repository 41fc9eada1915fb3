"""Matrix products through NumPy's BLAS: same results as torch, padding, and the
engine's use of the path (and of torch's threads) during a step."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_blas
from tokenmill.layers.linear import Linear


def test_rows_go_one_by_one_up_to_3_and_partial_panels_below_64_are_padded():
    assert [cpu_blas.padded_rows(n) for n in (1, 2, 3, 4, 7, 8, 9, 10, 12, 17, 28, 63, 64, 70)] \
        == [1, 2, 3, 8, 8, 8, 9, 16, 16, 17, 32, 64, 64, 70]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 12, 40, 70])
def test_linear_through_numpy_equals_torch(rows, transposed):
    torch.manual_seed(rows)
    layer = Linear(48, 80, bias=True, transposed=transposed)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(rows, 48)
    with torch.no_grad():
        expected = layer(x)
        cpu_blas.attach(layer)
        got = layer(x)
        got_3d = layer(x.view(1, rows, 48))
    assert got.shape == (rows, 80) and got_3d.shape == (1, rows, 80)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_3d[0], got)


def test_autograd_keeps_the_torch_path():
    layer = Linear(8, 4)
    torch.nn.init.normal_(layer.weight)
    cpu_blas.attach(layer)
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(3, 8))


def test_numpy_blas_needs_float32_on_cpu(llama_dir):
    with pytest.raises(ValueError, match="cpu_blas"):
        LLM(str(llama_dir), progress=False, cpu_blas="numpy", dtype="bfloat16")
    with pytest.raises(ValueError, match="cpu_blas"):
        LLM(str(llama_dir), progress=False, cpu_blas="fast")


@pytest.mark.parametrize("setting, expect_numpy", [("auto", True), ("torch", False)])
def test_engine_step_routes_products_and_restores_threads(llama_dir, monkeypatch, setting,
                                                         expect_numpy):
    calls = []
    real = cpu_blas.matmul
    monkeypatch.setattr(cpu_blas, "matmul", lambda x, w: calls.append(
        torch.get_num_threads()) or real(x, w))
    llm = LLM(str(llama_dir), progress=False, cpu_blas=setting)
    before = torch.get_num_threads()
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    assert torch.get_num_threads() == before
    assert bool(calls) == expect_numpy
    # During the step torch's own pool is one thread, so it never spins against BLAS.
    assert set(calls) <= {1}
