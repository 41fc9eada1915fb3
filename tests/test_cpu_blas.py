"""CPU matrix products through oneDNN (packed weights) and NumPy's BLAS as linear methods:
same results as torch, padding, memory (one copy of each weight), and the engine's use
of the paths (and of torch's threads) during a step."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_blas, native_linear
from tokenmill.layers.linear import Linear, linear_weight_bytes
from tokenmill.layers.products import product_policy

KINDS = [pytest.param("onednn", marks=pytest.mark.skipif(
    not cpu_blas.onednn_available(), reason="torch built without oneDNN")), "numpy",
    pytest.param("native", marks=pytest.mark.skipif(
        not native_linear.available(), reason="no C++ compiler"))]
needs_native = pytest.mark.skipif(not native_linear.available(), reason="no C++ compiler")


def test_rows_go_one_by_one_up_to_3_and_partial_panels_below_64_are_padded():
    assert [cpu_blas.padded_rows(n) for n in (1, 2, 3, 4, 7, 8, 9, 10, 12, 17, 28, 63, 64, 70)] \
        == [1, 2, 3, 8, 8, 8, 9, 16, 16, 17, 32, 64, 64, 70]


def test_onednn_rows_take_a_bounded_set_of_sizes():
    assert [cpu_blas.onednn_rows(n) for n in (1, 7, 8, 9, 16, 17, 64, 65, 512, 513, 2048)] \
        == [1, 7, 8, 16, 16, 24, 64, 96, 512, 640, 2048]
    assert len({cpu_blas.onednn_rows(n) for n in range(1, 2049)}) <= 45


def method_layer(reference: Linear, kind: str) -> Linear:
    """A copy of `reference` on the method the `kind` products pick for its shape."""
    policy = product_policy(kind, torch.device("cpu"), torch.float32)
    layer = Linear(reference.in_features, reference.out_features,
                   bias=reference.bias is not None)
    layer.keep_weight = reference.keep_weight
    layer.set_method(policy.select("layer", layer))
    layer.load("weight", reference.weight.detach())
    if reference.bias is not None:
        layer.load("bias", reference.bias.detach())
    layer.method.finalize(layer)
    return layer


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(48, 80), (80, 48)])  # wide (stored transposed) and tall
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 12, 40, 70, 600])
def test_linear_through_cpu_products_equals_torch(rows, shape, kind):
    torch.manual_seed(rows)
    reference = Linear(*shape, bias=True)
    torch.nn.init.normal_(reference.weight)
    torch.nn.init.normal_(reference.bias)
    x = torch.randn(rows, shape[0])
    with torch.no_grad():
        expected = reference(x)
        layer = method_layer(reference, kind)
        got = layer(x)
        got_3d = layer(x.view(1, rows, shape[0]))
    assert got.shape == (rows, shape[1]) and got_3d.shape == (1, rows, shape[1])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_3d[0], got)


@pytest.mark.skipif(not cpu_blas.onednn_available(), reason="torch built without oneDNN")
def test_onednn_keeps_one_copy_of_each_weight_unless_it_is_read_elsewhere():
    plain, tied_plain = Linear(16, 32), Linear(16, 32)
    tied_plain.keep_weight = True
    for module in (plain, tied_plain):
        torch.nn.init.normal_(module.weight)
    x = torch.randn(3, 16)
    layer, tied = method_layer(plain, "onednn"), method_layer(tied_plain, "onednn")
    assert layer.weight.numel() == 0 and tied.weight.shape == (32, 16)
    packed_bytes = layer.packed_weight.numel() * layer.packed_weight.element_size()
    assert linear_weight_bytes(layer) == packed_bytes
    assert linear_weight_bytes(tied) == packed_bytes + 32 * 16 * 4  # the tied copy counted
    with torch.no_grad():
        torch.testing.assert_close(layer(x), plain(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tied.embedding(torch.tensor([3, 1])),
                               tied_plain.weight.detach()[[3, 1]])


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, 300])
@pytest.mark.parametrize("shape", [(600, 37), (256, 48), (20, 1)])  # in > one 256 chunk
def test_native_kernel_at_odd_widths_equals_torch(rows, shape):
    """Partial blocks of 16 channels, column chunks and row tiles with remainders,
    with and without a bias."""
    torch.manual_seed(rows)
    weight, bias = torch.randn(shape[1], shape[0]), torch.randn(shape[1])
    x = torch.randn(rows, shape[0])
    packed = native_linear.pack(weight)
    assert packed.shape == (-(-shape[1] // 16), shape[0], 16)
    torch.testing.assert_close(native_linear.unpack(packed, shape[1]), weight, rtol=0, atol=0)
    for b in (None, bias):
        got = native_linear.linear(x, packed, native_linear.padded_bias(b, packed), shape[1])
        expected = x @ weight.t() + (0 if b is None else b)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@needs_native
def test_threads_taking_each_others_work_give_the_same_bits_as_one_thread():
    """Four threads on this machine's cores finish their runs unevenly, and those done
    first take the others' last groups (share_out): every product and fused product
    equals one thread's bit for bit, whoever ran which group."""
    library = native_linear.library()
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    stolen = library.stolen_items()
    try:
        for rows in (1, 8, 300):
            for out, inp in ((1152, 896), (896, 1200), (608, 37)):
                weight, x = torch.randn(out, inp), torch.randn(rows, inp)
                packed = native_linear.pack(weight)
                torch.set_num_threads(1)
                plain = native_linear.linear(x, packed, None, out)
                fused = native_linear.linear_silu_mul(x, packed, None, out)
                for count in (2, 3, 4):
                    torch.set_num_threads(count)
                    for _ in range(20):
                        assert torch.equal(native_linear.linear(x, packed, None, out), plain)
                    assert torch.equal(native_linear.linear_silu_mul(x, packed, None, out),
                                       fused)
    finally:
        torch.set_num_threads(threads)
    assert library.stolen_items() > stolen


@pytest.mark.parametrize("shape", [(16, 3), (160, 37), (1152, 896)])
def test_packing_in_place_equals_packing_into_a_copy_and_reuses_the_memory(shape,
                                                                            monkeypatch):
    """Chunks of blocks smaller than the weight, a last chunk short, one block; a weight
    that is not alone on its storage or not whole blocks is packed into a copy."""
    monkeypatch.setattr(native_linear, "IN_PLACE_CHUNK_BYTES", 3 * 16 * shape[1] * 4)
    weight = torch.randn(*shape)
    expected = native_linear.pack(weight)
    assert native_linear.packs_in_place(weight)
    packed = native_linear.pack_in_place(weight)
    assert torch.equal(packed, expected) and packed.data_ptr() == weight.data_ptr()
    shared = torch.randn(2 * shape[0], shape[1])
    for other in (shared[:shape[0]], shared[shape[0]:], shared.t(),
                  torch.randn(shape[0] + 1, shape[1])):
        assert not native_linear.packs_in_place(other)


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 13, 33, 300])
@pytest.mark.parametrize("in_features, intermediate", [(600, 48), (40, 32), (20, 16)])
def test_fused_gate_up_activation_is_bit_identical_to_the_product_then_silu_mul(
        rows, in_features, intermediate):
    """Whole and partial groups of gate/up pairs, row tiles with remainders, more than one
    column chunk and one panel of rows, with and without a bias, batched inputs."""
    from tokenmill.layers.native import native_row_ops

    torch.manual_seed(rows + intermediate)
    weight = torch.randn(2 * intermediate, in_features) * 0.2
    packed = native_linear.pack(weight)
    x = torch.randn(rows, in_features) * 3  # sums far enough out to reach silu's tails
    for b in (None, native_linear.padded_bias(torch.randn(2 * intermediate), packed)):
        products = native_linear.linear(x, packed, b, 2 * intermediate)
        expected = native_row_ops().silu_mul(products)
        got = native_linear.linear_silu_mul(x, packed, b, 2 * intermediate)
        assert got.shape == (rows, intermediate) and torch.equal(got, expected)
        gate, up = products.chunk(2, dim=-1)
        torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up)
        batched = native_linear.linear_silu_mul(x.view(1, rows, -1), packed, b,
                                                2 * intermediate)
        assert torch.equal(batched, expected.view(1, rows, -1))


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 12, 16])
def test_decode_sized_tiles_equal_the_wide_ones_bit_for_bit(threads, rows):
    """Up to the build's limit, a product wide enough to give every thread four groups
    takes the decode tiles (AVX-512, up to 12 rows: 4 rows x 6 blocks, fused up to 8
    rows 4 rows x 3 units; AVX2, up to 16 rows: 2 rows x 2 blocks, fused below 20 rows
    2 rows x 2 units, below 8 without decode tiles). Each output sums its columns in the
    same order as in the wide tiles a 24-row product takes, so the rows come out
    bit-identical; partial blocks and groups, two column chunks, bias."""
    torch.manual_seed(rows)
    in_features, out_features, intermediate = 600, 1000, 400
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    gate_up = torch.randn(2 * intermediate, in_features) * 0.2
    x = torch.randn(24, in_features)
    packed, packed_gate_up = native_linear.pack(weight), native_linear.pack(gate_up)
    padded = native_linear.padded_bias(bias, packed)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    limit = native_linear.decode_rows()
    try:
        native_linear.set_decode_rows(native_linear.max_decode_rows())
        few = native_linear.linear(x[:rows], packed, padded, out_features)
        wide = native_linear.linear(x, packed, padded, out_features)[:rows]
        few_act = native_linear.linear_silu_mul(x[:rows], packed_gate_up, None, 2 * intermediate)
        products = native_linear.linear(x, packed_gate_up, None, 2 * intermediate)
        wide_act = native_linear.linear_silu_mul(x, packed_gate_up, None, 2 * intermediate)
        # A host that measured the wide tile faster takes it at every row count, and for
        # the fused activation (AVX-512) up to 32 rows 12 rows x 1 unit (the 24 rows
        # above took 6 rows x 2 units).
        native_linear.set_decode_rows(0)
        no_tiles = native_linear.linear(x[:rows], packed, padded, out_features)
        no_tiles_act = native_linear.linear_silu_mul(x[:rows], packed_gate_up, None,
                                                     2 * intermediate)
    finally:
        torch.set_num_threads(previous)
        native_linear.set_decode_rows(limit)
    assert torch.equal(few, wide) and torch.equal(no_tiles, wide)
    assert torch.equal(no_tiles_act, wide_act[:rows])
    torch.testing.assert_close(few, x[:rows] @ weight.t() + bias, atol=1e-4, rtol=1e-4)
    assert torch.equal(few_act, wide_act[:rows])
    gate, up = products[:rows].chunk(2, dim=-1)
    torch.testing.assert_close(few_act, torch.nn.functional.silu(gate) * up)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, in_features",
                         [(16, 600), (17, 600), (40, 600), (300, 600), (1030, 600),
                          (300, 5000)])
def test_products_of_rows_packed_by_tile_equal_each_row_alone_bit_for_bit(
        threads, rows, in_features):
    """From 16 rows the kernel reads x repacked tile by tile (a tile's rows interleaved)
    and later row tiles fetch the next chunk a stream each; every output still sums its
    columns in the same order, so each row equals that row multiplied alone (unpacked,
    the wide tile): uneven tiles, two panels of rows at 300, two column chunks (ten at a
    down projection's K, 5000, the partial sums kept in the output between them), bias,
    the fused activation too."""
    torch.manual_seed(rows)
    out_features, intermediate = 1000, 400
    scale = (600 / in_features) ** 0.5  # the sums' size at every K: the same bounds hold
    weight, bias = torch.randn(out_features, in_features) * scale, torch.randn(out_features)
    gate_up = torch.randn(2 * intermediate, in_features) * 0.2 * scale
    x = torch.randn(rows, in_features)
    packed, packed_gate_up = native_linear.pack(weight), native_linear.pack(gate_up)
    padded = native_linear.padded_bias(bias, packed)
    previous, limit = torch.get_num_threads(), native_linear.decode_rows()
    torch.set_num_threads(threads)
    try:
        native_linear.set_decode_rows(0)
        whole = native_linear.linear(x, packed, padded, out_features)
        whole_act = native_linear.linear_silu_mul(x, packed_gate_up, None, 2 * intermediate)
        alone = torch.cat([native_linear.linear(x[i:i + 1], packed, padded, out_features)
                           for i in range(rows)])
        alone_act = torch.cat([native_linear.linear_silu_mul(
            x[i:i + 1], packed_gate_up, None, 2 * intermediate) for i in range(rows)])
    finally:
        torch.set_num_threads(previous)
        native_linear.set_decode_rows(limit)
    assert torch.equal(whole, alone) and torch.equal(whole_act, alone_act)
    torch.testing.assert_close(whole, x @ weight.t() + bias, atol=1e-4, rtol=1e-4)
    gate, up = native_linear.linear(x, packed_gate_up, None, 2 * intermediate).chunk(2, -1)
    torch.testing.assert_close(whole_act, torch.nn.functional.silu(gate) * up)


@needs_native
def test_the_decode_tile_limit_is_checked():
    with pytest.raises(RuntimeError, match="decode rows must be 0"):
        native_linear.set_decode_rows(native_linear.max_decode_rows() + 1)
    with pytest.raises(RuntimeError, match="decode rows must be 0"):
        native_linear.set_decode_rows(-1)


@needs_native
def test_native_fuses_the_activation_only_where_the_halves_are_whole_blocks():
    x = torch.randn(5, 24)
    for out_features, fused in ((200, False), (48, False), (32, True), (64, True)):
        assert native_linear.fuses_silu_mul(out_features) is fused
        reference = Linear(24, out_features)
        torch.nn.init.normal_(reference.weight)
        layer = method_layer(reference, "native")
        gate, up = (x @ reference.weight.detach().t()).chunk(2, dim=-1)
        with torch.no_grad():
            torch.testing.assert_close(layer(x, silu_mul=True), torch.nn.functional.silu(gate) * up)
        # With autograd on, the torch form runs (the packed kernel does not train).
        torch.testing.assert_close(layer(x, silu_mul=True), torch.nn.functional.silu(gate) * up)
    with pytest.raises(RuntimeError, match="gate \\| up"):
        native_linear.linear_silu_mul(x, native_linear.pack(torch.randn(48, 24)), None, 48)
    with torch.no_grad(), pytest.raises(RuntimeError, match="columns"):
        layer(torch.randn(2, 23), silu_mul=True)


@needs_native
def test_native_keeps_one_copy_checks_shapes_and_saves_the_weight():  # a tied head's too
    plain = Linear(40, 24)
    torch.nn.init.normal_(plain.weight)
    layer = method_layer(plain, "native")
    assert layer.weight.numel() == 0
    assert linear_weight_bytes(layer) == 2 * 40 * 16 * 4  # two blocks of 16 channels
    torch.testing.assert_close(layer.method.checkpoint_weight(layer), plain.weight.detach(),
                               rtol=0, atol=0)
    # The memory plan counts the padded blocks: a router-like 4-row layer takes one
    # block of 16; a tied head keeps no plain copy: its embedding reads packed rows.
    policy = product_policy("native", torch.device("cpu"), torch.float32)
    for rows, tied in ((24, False), (4, False), (4, True), (37, True)):
        reference = Linear(40, rows)
        reference.keep_weight = tied
        torch.nn.init.normal_(reference.weight)
        built = method_layer(reference, "native")
        assert built.weight.numel() == 0
        assert policy.planned_weight_bytes("x", reference, torch.float32) == \
            linear_weight_bytes(built) == -(-rows // 16) * 16 * 40 * 4
        ids = torch.tensor([[rows - 1, 0, rows // 2], [1, rows - 1, 0]])
        assert torch.equal(built.embedding(ids), reference.weight.detach()[ids])
    with pytest.raises(RuntimeError, match="columns"):
        layer(torch.randn(2, 41))
    with pytest.raises(RuntimeError, match="float32"):
        layer(torch.randn(2, 40, dtype=torch.float64))


def test_layers_built_outside_the_loader_are_plain_and_train():
    layer = Linear(8, 4)
    torch.nn.init.normal_(layer.weight)
    assert layer.method.name == "plain"
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(3, 8))


def test_cpu_products_need_float32_on_cpu(llama_dir):
    for setting in ("numpy", "onednn", "native"):
        with pytest.raises(ValueError, match="cpu_blas"):
            LLM(str(llama_dir), progress=False, cpu_blas=setting, dtype="bfloat16")
    with pytest.raises(ValueError, match="cpu_blas"):
        LLM(str(llama_dir), progress=False, cpu_blas="fast")


@pytest.mark.parametrize("setting", ["auto", "onednn", "numpy", "native", "torch"])
def test_engine_step_routes_products_and_restores_threads(llama_dir, monkeypatch, setting):
    if setting in ("auto", "onednn") and not cpu_blas.onednn_available():
        pytest.skip("torch built without oneDNN")
    if setting == "native" and not native_linear.available():
        pytest.skip("no C++ compiler")
    calls = {"onednn": [], "numpy": [], "native": []}
    real_onednn, real_numpy = cpu_blas.onednn_linear, cpu_blas.matmul
    real_native = native_linear.linear
    monkeypatch.setattr(cpu_blas, "onednn_linear", lambda *a: calls["onednn"].append(
        torch.get_num_threads()) or real_onednn(*a))
    monkeypatch.setattr(cpu_blas, "matmul", lambda x, w: calls["numpy"].append(
        torch.get_num_threads()) or real_numpy(x, w))
    monkeypatch.setattr(native_linear, "linear", lambda *a: calls["native"].append(
        torch.get_num_threads()) or real_native(*a))
    before = torch.get_num_threads()
    llm = LLM(str(llama_dir), progress=False, cpu_blas=setting)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    assert torch.get_num_threads() == before
    expected = {"auto": "onednn", "torch": None}.get(setting, setting)
    assert {kind for kind, seen in calls.items() if seen} == ({expected} if expected else set())
    if expected == "numpy":
        # torch's own pool is one thread during the step, so it never spins against BLAS.
        assert set(calls["numpy"]) == {1}
    if expected in ("onednn", "native"):
        # oneDNN and the native kernel run on torch's pool, at its full size.
        assert set(calls[expected]) == {before}
