"""Float32 products through tokenmill's own kernel (`--cpu-blas native`).

The weight is packed once at load into blocks of 16 output channels, [blocks, in, 16]
(csrc/f32_linear.cpp): a block's column is one vector, every block one contiguous
stream. The kernel shares each loaded column between up to 8 rows and 3 blocks held in
registers, for every row count: one row streams the weight at the memory's pace
(oneDNN's packed inner product streamed it at 0.5-0.7 of that on this project's AMD
hosts), many rows multiply at a rate close to oneDNN's. Measured per host like the
other paths (`tokenmill tune`, the start-up probe of `--cpu-blas auto`). The packed
form replaces the plain weight, in the loaded weight's own memory where its channels
fill whole blocks, a tied LM head's too: the embedding reads its rows out of the
packed blocks (a token's row is one lane of its block). Sums run in another
order than a BLAS does: results differ from torch's by rounding.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from tokenmill.layers import huge_pages, weight_arena
from tokenmill.layers.linear_method import Linear, PlainLinearMethod
from tokenmill.layers.native import build_extension, row_ops_for

SOURCE = Path(__file__).resolve().parent / "csrc" / "f32_linear.cpp"
# -fno-trapping-math: nothing reads the floating-point exception flags, and without it
# GCC keeps the fused activation's range selects out of vectors under AVX2 (as in
# row_ops.cpp); it changes no rounding.
# TOKENMILL_KERNEL_DEFINES ("TM_STEAL=0 TM_CHUNK=128"): another build of the kernel's
# compile-time settings (csrc/f32_tiles.h), in this process and the ones it starts
# (a served engine), for A/B runs (benchmarks/with_kernel_build.py sets it).
FLAGS = ("-fno-trapping-math",
         *(f"-D{d}" for d in os.environ.get("TOKENMILL_KERNEL_DEFINES", "").split()))
LANES = 16


@functools.cache  # (no arguments: a lookup per product costs nothing)
def library():
    """The compiled kernel (built once per CPU and torch version), or None where it
    cannot be built."""
    return build_extension("f32_linear", SOURCE, FLAGS)


def available() -> bool:
    return library() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [blocks, in, 16], channels past `out` zero."""
    out_features, in_features = weight.shape
    blocks = -(-out_features // LANES)
    padded = weight.detach()
    if out_features % LANES:
        padded = padded.new_zeros(blocks * LANES, in_features)
        padded[:out_features] = weight.detach()
    source = padded.view(blocks, LANES, in_features).transpose(1, 2)
    packed = huge_pages.empty_like(source)  # in huge pages where the loader asks for them
    return packed.copy_(source)


# Bytes of [16, in] blocks `pack_in_place` moves through its scratch at a time.
IN_PLACE_CHUNK_BYTES = 4 * 2**20


def packs_in_place(weight: torch.Tensor) -> bool:
    """Whether `pack_in_place` takes `weight`: whole blocks of 16 channels, contiguous,
    and its bytes its own: its storage holds nothing else, or it is a slot of the weight
    arena (a freshly loaded parameter; the plain layout is gone afterwards, so a caller
    must not read the weight as [out, in] again)."""
    storage = weight.untyped_storage()
    return (weight.shape[0] % LANES == 0 and weight.is_contiguous()
            and (weight_arena.is_slot(weight) or (
                weight.storage_offset() == 0
                and storage.nbytes() == weight.numel() * weight.element_size())))


def pack_in_place(weight: torch.Tensor) -> torch.Tensor:
    """`pack(weight)` in `weight`'s own memory (see `packs_in_place`), which it reuses.

    Block b of 16 channels covers the same bytes in both layouts ([16, in] rows before,
    [in, 16] after), so blocks are transposed a few at a time through a small scratch.
    No second copy of the weights is allocated: at load that copy's pages were faulted
    in afresh, most of the time `pack` took on a VM's cold memory."""
    out_features, in_features = weight.shape
    blocks = out_features // LANES
    rows = weight.detach().view(blocks, LANES, in_features)
    packed = weight.detach().view(blocks, in_features, LANES)
    step = max(1, IN_PLACE_CHUNK_BYTES // (LANES * in_features * weight.element_size()))
    scratch = rows.new_empty(min(step, blocks), LANES, in_features)
    for start in range(0, blocks, step):
        stop = min(start + step, blocks)
        chunk = scratch[:stop - start].copy_(rows[start:stop])
        packed[start:stop].copy_(chunk.transpose(1, 2))
    return packed


def packed_bytes(layer: Linear, dtype: torch.dtype) -> int:
    """Bytes of the packed form: the output channels rounded up to whole blocks of 16
    (a MoE router's few rows take a block)."""
    blocks = -(-layer.out_features // LANES)
    return blocks * LANES * layer.in_features * dtype.itemsize


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The [out, in] weight `pack` was given."""
    blocks, in_features, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * LANES, in_features)[:out_features]


def padded_bias(bias: torch.Tensor | None, packed: torch.Tensor) -> torch.Tensor | None:
    if bias is None:
        return None
    padded = bias.detach().new_zeros(packed.shape[0] * LANES)
    padded[:bias.shape[0]] = bias.detach()
    return padded


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
           out_features: int) -> torch.Tensor:
    """x [..., in] @ W.T + bias with W packed by `pack` and bias by `padded_bias`."""
    if x.dim() == 2:
        return library().f32_linear(x, packed, bias, out_features)
    out = library().f32_linear(x.reshape(-1, x.shape[-1]), packed, bias, out_features)
    return out.view(*x.shape[:-1], out_features)


def build_name() -> str:
    """The compiled kernel's name: its sources, flags, CPU and torch hashed into it."""
    return library().__name__


def max_decode_rows() -> int:
    """The build's decode-tile limit (TM_DECODE_ROWS): products of up to this many rows
    take the decode tiles unless `set_decode_rows` lowers it."""
    return library().max_decode_rows


def set_decode_rows(rows: int) -> None:
    """Products of up to `rows` rows take the decode tiles (0: the wide tile at every row
    count); which is faster differs by host, so layers/product_table.py measures it."""
    library().set_decode_rows(rows)


def decode_rows() -> int:
    return library().decode_rows()


def built_stream_ahead() -> int:
    """The build's fetch distance (TM_STREAM_AHEAD, columns)."""
    return library().built_stream_ahead


def set_stream_ahead(columns: int, rows: int = 1) -> None:
    """How many columns ahead a product of a few rows fetches its own weights (0:
    none), for `rows`' class: up to `one_ahead_rows()` rows, or more (each its own
    distance); the best distance differs by host and rows (layers/fetch_distance.py
    measures both)."""
    library().set_stream_ahead(columns, rows)


def stream_ahead(rows: int = 1) -> int:
    return library().stream_ahead(rows)


def one_ahead_rows() -> int:
    """The most rows that take the one-row class's fetch distance."""
    return library().one_ahead_rows


def fuses_silu_mul(out_features: int) -> bool:
    """Whether the fused gate/up activation takes a [gate | up] layer this wide: both
    halves whole blocks of 16 channels."""
    return out_features % (2 * LANES) == 0


def linear_silu_mul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                    out_features: int) -> torch.Tensor:
    """silu(gate) * up of x [..., in] times a [gate | up] weight packed by `pack`:
    [..., out_features / 2], bit-identical to `linear` followed by row_ops' silu_mul,
    without the [..., out_features] products in memory (csrc/f32_linear.cpp)."""
    flat = x.reshape(-1, x.shape[-1])
    out = library().f32_linear_silu_mul(flat, packed, bias, out_features)
    return out.view(*x.shape[:-1], out_features // 2)


class NativeLinearMethod(PlainLinearMethod):
    """Loads into the checkpoint layout, then packs once for the kernel (inference only)."""

    name = "native"

    def finalize(self, layer: Linear) -> None:
        weight = layer.weight
        layer.native_weight = pack_in_place(weight) if packs_in_place(weight) else pack(weight)
        layer.native_bias = padded_bias(layer.bias, layer.native_weight)
        # One copy of the weight from here on: the packed one (a tied head's embedding
        # reads it too, see `embedding`).
        layer.weight.data = layer.weight.data.new_empty(0)

    def arena_weight(self, layer: Linear) -> bool:
        return layer.out_features % LANES == 0  # packed in place (`packs_in_place`)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return linear(x, layer.native_weight, layer.native_bias, layer.out_features)

    def apply_silu_mul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or not fuses_silu_mul(layer.out_features):
            return super().apply_silu_mul(layer, x)
        return linear_silu_mul(x, layer.native_weight, layer.native_bias, layer.out_features)

    def embedding(self, layer: Linear, token_ids: torch.Tensor) -> torch.Tensor:
        # Row r is lane r % 16 of block r // 16: [..., in] gathered from the packed form.
        packed = layer.native_weight
        ops = row_ops_for(packed) if token_ids.dim() == 1 else None
        if ops is not None and token_ids.dtype == torch.int64:
            return ops.packed_rows(packed, token_ids.contiguous())
        return packed[token_ids // LANES, :, token_ids % LANES]

    def checkpoint_weight(self, layer: Linear) -> torch.Tensor:
        if layer.weight.numel():
            return layer.weight.detach()
        return unpack(layer.native_weight, layer.out_features)

    def weight_bytes(self, layer: Linear) -> int:
        packed = layer.native_weight
        return super().weight_bytes(layer) + packed.numel() * packed.element_size()


NATIVE = NativeLinearMethod()
