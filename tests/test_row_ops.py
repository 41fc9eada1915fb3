"""The compiled per-row operators (layers/csrc/row_ops.cpp) against the torch forms they
replace: rotary embedding bit for bit (on Q and K side by side in a fused QKV row, as
the model calls it), RMSNorm to an ulp or two, the residual add before a norm bit for
bit, silu(gate) * up to a few ulp (its own exponential, extremes included), argmax index
for index (ties, NaNs, infinities, rows of every length), a packed weight's rows (the
tied embedding) as the plain weight's; autograd keeps the torch forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers import native_linear
from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.native import native_row_ops
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary, rotate
from tokenmill.layers.sampler import greedy

pytestmark = pytest.mark.skipif(native_row_ops() is None, reason="no C++ compiler")


@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_rotation_in_place_is_bit_identical(tokens):
    generator = torch.Generator().manual_seed(tokens)
    heads, kv_heads, head_dim = 6, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    rotary = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0})
    rotary.build_cache()
    rope = rotary(torch.randint(0, 4096, (tokens,), generator=generator), torch.float32)
    expected = apply_rotary(qk.clone(), rope)
    values = qkv[:, (heads + kv_heads) * head_dim:].clone()
    with torch.inference_mode():
        out = rotate(qk, rope)
    assert out.data_ptr() == qk.data_ptr()  # in place, in the QKV buffer
    assert torch.equal(out, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], values)  # V untouched


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_matches_the_torch_form(rows):
    norm = RMSNorm(896, 1e-6)
    norm.weight.data.normal_()
    x = torch.randn(rows, 896) * 3
    reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    with torch.inference_mode():
        out = norm(x)
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_and_norm_is_the_add_then_the_norm(rows):
    norm = RMSNorm(896, 1e-6)
    norm.weight.data.normal_()
    residual, delta = torch.randn(rows, 896) * 3, torch.randn(rows, 896)
    with torch.inference_mode():
        total, normed = norm.add_and_norm(residual, delta)
        assert torch.equal(total, residual + delta)
        assert torch.equal(normed, norm(residual + delta))


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_silu_and_mul_matches_the_torch_form(rows):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * 4864, generator=generator) * 4
    # Where the exponential saturates: silu is 0 (or -0) far below zero, x far above.
    x[0, :8] = torch.tensor([-1e4, -100.0, -87.5, -20.0, 0.0, 1e-30, 30.0, 1e4])
    gate, up = x.chunk(2, dim=-1)
    reference = F.silu(gate) * up
    with torch.inference_mode():
        out = silu_and_mul(x)
    assert out.shape == (rows, 4864)
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("width", [1, 5, 63, 64, 65, 1000, 151936])
def test_argmax_is_torchs(width):
    generator = torch.Generator().manual_seed(width)
    x = torch.randn(6, width, generator=generator)
    x[1] = 3.0  # every value tied: the first
    x[2] = float("-inf")
    x[3, width // 2] = float("inf")
    x[4, -1] = float("nan")  # a NaN wins, as in torch
    x[4, width // 3] = float("nan")
    x[5, -1] = 50.0  # the maximum in the tail past the last whole chunk
    with torch.inference_mode():
        assert torch.equal(native_row_ops().argmax(x), x.argmax(dim=-1))
        assert torch.equal(greedy(x), x.argmax(dim=-1))
        assert torch.equal(greedy(x[:, :1].contiguous()), torch.zeros(6, dtype=torch.int64))
        strided = x.t()[:1].t()  # not contiguous: torch's own
        assert torch.equal(greedy(strided), strided.argmax(dim=-1))
        if width >= 2**15:  # fewer rows than threads: each row scanned in pieces, merged
            x[0, 7] = x[0, -9] = x[0].max() + 1  # a tie across pieces: the first
            before = torch.get_num_threads()
            try:
                for threads in (2, 3):
                    torch.set_num_threads(threads)
                    for row in range(len(x)):
                        one = x[row:row + 1]
                        assert torch.equal(native_row_ops().argmax(one), one.argmax(dim=-1))
            finally:
                torch.set_num_threads(before)


@pytest.mark.parametrize("out_features", [16, 45, 200])
def test_packed_rows_are_the_plain_weights_rows(out_features):
    if not native_linear.available():
        pytest.skip("no native kernel")
    weight = torch.randn(out_features, 24, generator=torch.Generator().manual_seed(1))
    packed = native_linear.pack(weight)
    ids = torch.tensor([0, out_features - 1, 7 % out_features, 3, 3])
    with torch.inference_mode():
        assert torch.equal(native_row_ops().packed_rows(packed, ids), weight[ids])
        assert torch.equal(native_linear.NATIVE.embedding(_Tied(packed), ids), weight[ids])
        assert native_row_ops().packed_rows(packed, ids[:0]).shape == (0, 24)
    with pytest.raises(RuntimeError, match="is not in"):  # past the last block, negative
        native_row_ops().packed_rows(packed, torch.tensor([packed.shape[0] * 16]))
    with pytest.raises(RuntimeError, match="is not in"):
        native_row_ops().packed_rows(packed, torch.tensor([-1]))


class _Tied:  # what NativeLinearMethod.embedding reads of a layer
    def __init__(self, packed: torch.Tensor) -> None:
        self.native_weight = packed


def test_autograd_keeps_the_torch_forms():
    norm = RMSNorm(64, 1e-5)
    x = torch.randn(3, 64, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    q = torch.randn(3, 2, 64, requires_grad=True)
    rope = (torch.randn(3, 1, 32), torch.randn(3, 1, 32))
    rotate(q, rope).sum().backward()
    assert q.grad is not None
    x = torch.randn(3, 64, requires_grad=True)
    silu_and_mul(x).sum().backward()
    assert x.grad is not None


def test_a_build_killed_mid_compile_does_not_hang_later_starts(tmp_path):
    """A start-up killed while compiling leaves torch's build lock behind; the next
    build removes it (no live compile holds tokenmill's own lock) instead of waiting
    forever. Built from a checkout at another path, the kernel is not rebuilt."""
    import shutil
    import threading

    from tokenmill.layers import isa, native

    assert native.native_row_ops() is not None  # built (or found) with the real flags
    flags = (*native.ROW_OPS_FLAGS, *isa.kernel_flags())
    elsewhere = tmp_path / "checkout" / "row_ops.cpp"
    elsewhere.parent.mkdir()
    for original in (native.ROW_OPS_SOURCE, *native.headers(native.ROW_OPS_SOURCE)):
        shutil.copy(original, elsewhere.parent / original.name)
    build_dir = native.CACHE / "kernels" / f"row_ops-{native.build_key(elsewhere, flags)}"
    library = next(build_dir.glob("*.so"))
    built_at = library.stat().st_mtime
    (build_dir / "lock").touch()  # what a killed compile leaves
    result = []
    worker = threading.Thread(target=lambda: result.append(
        native.compiled.__wrapped__("row_ops", elsewhere, flags)), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert result and result[0] is not None, "the build waited on a stale lock"
    assert not (build_dir / "lock").exists()
    assert library.stat().st_mtime == built_at  # same text, other path: no rebuild
