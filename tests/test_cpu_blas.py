"""CPU matrix products through oneDNN (packed weights) and NumPy's BLAS: same results as
torch, padding, memory (one copy of each weight), and the engine's use of the paths
(and of torch's threads) during a step."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_blas
from tokenmill.layers.linear import Linear

KINDS = [pytest.param("onednn", marks=pytest.mark.skipif(
    not cpu_blas.onednn_available(), reason="torch built without oneDNN")), "numpy"]


def test_rows_go_one_by_one_up_to_3_and_partial_panels_below_64_are_padded():
    assert [cpu_blas.padded_rows(n) for n in (1, 2, 3, 4, 7, 8, 9, 10, 12, 17, 28, 63, 64, 70)] \
        == [1, 2, 3, 8, 8, 8, 9, 16, 16, 17, 32, 64, 64, 70]


def test_onednn_rows_take_a_bounded_set_of_sizes():
    assert [cpu_blas.onednn_rows(n) for n in (1, 7, 8, 9, 16, 17, 64, 65, 512, 513, 2048)] \
        == [1, 7, 8, 16, 16, 24, 64, 96, 512, 640, 2048]
    assert len({cpu_blas.onednn_rows(n) for n in range(1, 2049)}) <= 45


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 12, 40, 70, 600])
def test_linear_through_cpu_products_equals_torch(rows, transposed, kind):
    torch.manual_seed(rows)
    layer = Linear(48, 80, bias=True, transposed=transposed)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(rows, 48)
    with torch.no_grad():
        expected = layer(x)
        cpu_blas.attach(layer, kind)
        got = layer(x)
        got_3d = layer(x.view(1, rows, 48))
    assert got.shape == (rows, 80) and got_3d.shape == (1, rows, 80)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_3d[0], got)


@pytest.mark.skipif(not cpu_blas.onednn_available(), reason="torch built without oneDNN")
def test_onednn_keeps_one_copy_of_each_weight_unless_it_is_read_elsewhere():
    layer, tied = Linear(16, 32), Linear(16, 32)
    tied.keep_weight = True
    for module in (layer, tied):
        torch.nn.init.normal_(module.weight)
    x = torch.randn(3, 16)
    expected = x @ layer.weight.detach().t()
    cpu_blas.attach(layer, "onednn")
    cpu_blas.attach(tied, "onednn")
    cpu_blas.attach(layer, "onednn")  # attaching again (a shared module) changes nothing
    assert layer.weight.numel() == 0 and tied.weight.shape == (32, 16)
    # Without the plain weight the packed product serves even with autograd on.
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_autograd_keeps_the_torch_path():
    layer = Linear(8, 4)
    torch.nn.init.normal_(layer.weight)
    cpu_blas.attach(layer, "numpy")
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(3, 8))


def test_cpu_products_need_float32_on_cpu(llama_dir):
    for setting in ("numpy", "onednn"):
        with pytest.raises(ValueError, match="cpu_blas"):
            LLM(str(llama_dir), progress=False, cpu_blas=setting, dtype="bfloat16")
    with pytest.raises(ValueError, match="cpu_blas"):
        LLM(str(llama_dir), progress=False, cpu_blas="fast")


@pytest.mark.parametrize("setting", ["auto", "onednn", "numpy", "torch"])
def test_engine_step_routes_products_and_restores_threads(llama_dir, monkeypatch, setting):
    if setting in ("auto", "onednn") and not cpu_blas.onednn_available():
        pytest.skip("torch built without oneDNN")
    calls = {"onednn": [], "numpy": []}
    real_onednn, real_numpy = cpu_blas.onednn_linear, cpu_blas.matmul
    monkeypatch.setattr(cpu_blas, "onednn_linear", lambda *a: calls["onednn"].append(
        torch.get_num_threads()) or real_onednn(*a))
    monkeypatch.setattr(cpu_blas, "matmul", lambda x, w: calls["numpy"].append(
        torch.get_num_threads()) or real_numpy(x, w))
    before = torch.get_num_threads()
    llm = LLM(str(llama_dir), progress=False, cpu_blas=setting)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    assert torch.get_num_threads() == before
    expected = {"auto": "onednn", "torch": None}.get(setting, setting)
    assert {kind for kind, seen in calls.items() if seen} == ({expected} if expected else set())
    if expected == "numpy":
        # torch's own pool is one thread during the step, so it never spins against BLAS.
        assert set(calls["numpy"]) == {1}
    if expected == "onednn":
        # oneDNN runs on torch's pool, at its full size.
        assert set(calls["onednn"]) == {before}
