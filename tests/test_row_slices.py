"""MLPs over large batches a slice of rows at a time (layers/row_slices.py)."""

from __future__ import annotations

import pytest
import torch

from tests.models import FAMILIES
from tests.test_parity import check_against_transformers
from tokenmill.config import ModelConfig
from tokenmill.layers import row_slices
from tokenmill.layers.linear import bind_linear_methods, finalize_linear_methods
from tokenmill.layers.products import LINEAR_METHODS
from tokenmill.layers.row_slices import auto_slice_rows, in_row_slices, set_mlp_slice_rows
from tokenmill.model import llama
from tokenmill.model.llama import GatedMLP


def test_slices_fill_a_third_of_the_cache_in_whole_row_tiles():
    # The 0.5B shape's gate/up output (9728 floats a row) in a 32 MB cache: 287 -> 256.
    assert auto_slice_rows(9728 * 4, cache_bytes=32 * 2**20) == 256
    assert auto_slice_rows(9728 * 4, cache_bytes=16 * 2**20) == 128
    # A guest that reports its host's whole 480 MB L3 sizes slices to 64 MB of it.
    assert auto_slice_rows(9728 * 4, cache_bytes=480 * 2**20) == 512
    # Never fewer than one step of rows, however wide the row or small the cache.
    assert auto_slice_rows(10**9, cache_bytes=2**20) == 64
    # Narrow rows: slices so large that no real batch is split.
    assert auto_slice_rows(256 * 4, cache_bytes=32 * 2**20) == 10880


@pytest.mark.parametrize("method", ["plain", "native"])
@pytest.mark.parametrize("rows", [1, 7, 64, 65, 200])
def test_an_mlp_in_slices_equals_the_whole_batch(method, rows):
    torch.manual_seed(0)
    mlp = GatedMLP(48, 160, bias=True)
    bind_linear_methods(mlp, lambda name, layer: LINEAR_METHODS[method])
    for parameter in mlp.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    finalize_linear_methods(mlp)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        whole = mlp(x)
        mlp.slice_rows = 16
        sliced = mlp(x)
    assert sliced.shape == whole.shape == (rows, 48)
    if method == "native":  # a row's sums do not depend on the others: the same bits
        assert torch.equal(sliced, whole)
    else:  # a BLAS may pick another algorithm for another row count: rounding only
        torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-5)


def test_slices_are_for_inference_only():
    mlp = GatedMLP(8, 16, bias=False)
    mlp.slice_rows = 2
    x = torch.randn(5, 8, requires_grad=True)
    mlp(x).sum().backward()  # the whole batch at once: autograd sees one graph
    assert x.grad is not None and x.grad.shape == x.shape


def test_the_setting_reaches_every_mlp():
    model = torch.nn.Sequential(GatedMLP(8, 16, False), GatedMLP(8, 4096, False))
    cpu = torch.device("cpu")
    assert set_mlp_slice_rows(model, 0, 4, cpu) == []
    assert [m.slice_rows for m in model] == [0, 0]
    assert set_mlp_slice_rows(model, 24, 4, cpu) == [24]
    assert [m.slice_rows for m in model] == [24, 24]
    sized = set_mlp_slice_rows(model, None, 4, cpu)  # per width from this host's cache
    assert [m.slice_rows for m in model] == [auto_slice_rows(32 * 4), auto_slice_rows(8192 * 4)]
    assert sized == sorted({auto_slice_rows(32 * 4), auto_slice_rows(8192 * 4)})
    # A CPU's cache sizes CPU work only.
    assert set_mlp_slice_rows(model, None, 4, torch.device("meta")) == []
    assert [m.slice_rows for m in model] == [0, 0]


def test_the_cache_size_is_read_from_sysfs_or_falls_back(monkeypatch, tmp_path):
    for name, level, size in (("index0", "1", "32K"), ("index2", "2", "1024K"),
                              ("index3", "3", "32768K"), ("index4", "4", "bogus")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "level").write_text(level + "\n")
        (tmp_path / name / "size").write_text(size + "\n")
    real_path = row_slices.Path
    monkeypatch.setattr(row_slices, "Path", lambda text: tmp_path if "sys" in text
                        else real_path(text))
    row_slices.last_level_cache_bytes.cache_clear()
    try:
        assert row_slices.last_level_cache_bytes() == 32 * 2**20  # unreadable level 4 skipped
        for name in ("index0", "index2", "index3", "index4"):
            (tmp_path / name / "size").unlink()
        row_slices.last_level_cache_bytes.cache_clear()
        assert row_slices.last_level_cache_bytes() == row_slices.FALLBACK_BYTES
    finally:
        row_slices.last_level_cache_bytes.cache_clear()


@pytest.mark.parametrize("rows", [-1, 2.5, "256", True])
def test_a_bad_slice_is_refused_by_name(rows):
    with pytest.raises(ValueError, match="mlp_slice_rows"):
        ModelConfig(mlp_slice_rows=rows)


def test_in_row_slices_covers_a_ragged_tail():
    x = torch.arange(30.0).view(10, 3)
    out = in_row_slices(lambda rows: rows.sum(1, keepdim=True).repeat(1, 2), x, 4, 2)
    assert torch.equal(out, x.sum(1, keepdim=True).repeat(1, 2))


# Prompts of 41 and 20-odd tokens prefilled together: every gated MLP runs in slices of
# 8 (the families whose MLP is one, or that have one as a shared expert; Mixtral and
# Qwen3-MoE have only routed experts).
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"mixtral", "qwen3_moe"}))
def test_engine_with_sliced_mlps_matches_transformers(family, model_factory, monkeypatch):
    sliced = []

    def counted(fn, x, rows, out_features):
        sliced.append(x.shape[0])
        return in_row_slices(fn, x, rows, out_features)

    monkeypatch.setattr(llama, "in_row_slices", counted)
    check_against_transformers(model_factory(family), mlp_slice_rows=8)
    assert sliced and min(sliced) > 8  # the prefill went through in slices
