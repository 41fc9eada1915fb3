"""How a Linear layer stores its weight and multiplies by it: one `LinearMethod` per
weight form, chosen once per layer at load (`layers/products.py`), never branched on
in `Linear.forward`.

A method is stateless; whatever it keeps per layer (the weight in its layout, a packed
copy, a quantized form) lives on the layer. Its life cycle:

    create_weights(layer)        the parameters checkpoint tensors are loaded into
    load_weight(layer, t, rows)  copy a checkpoint tensor [out_rows, in] into output rows
    finalize(layer)              after every tensor is in: pack, quantize, free copies
    apply(layer, x)              x [..., in] -> [..., out] (bias included)
    apply_silu_mul(layer, x)     a gated MLP's [gate | up] layer and its activation:
                                 silu(gate) * up, [..., out / 2] (a method may fuse them)

Weight quantization, tensor-parallel shards and new CPU kernels are new methods
registered in `LINEAR_METHODS`, not new branches here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.block_tensor import BlockTensor
from tokenmill.layers.quantized_tensor import SavedQuantTensor


class Linear(Protocol):
    """What a method reads and sets on its layer (layers/linear.py's `Linear`)."""

    in_features: int
    out_features: int
    weight: nn.Parameter
    bias: nn.Parameter | None
    # The plain weight is read for more than products (a tied LM head's embedding).
    keep_weight: bool
    # How tensor parallelism splits it: None, "column", "row", "row_partial", "vocab".
    parallel: str | None


class LinearMethod(ABC):
    name: str

    def create_weights(self, layer: Linear) -> None:
        """Register `layer.weight` in the checkpoint layout [out, in] (the default)."""
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features))

    def load_weight(self, layer: Linear, tensor: torch.Tensor, rows: slice) -> None:
        """Copy a checkpoint tensor [rows, in] into the layer's output rows `rows`."""
        _copy_checked(layer.weight[rows], tensor)

    def load_bias(self, layer: Linear, tensor: torch.Tensor, rows: slice) -> None:
        """Copy a checkpoint bias [rows] into the layer's output rows `rows`."""
        _copy_checked(layer.bias[rows], tensor)

    def finalize(self, layer: Linear) -> None:
        """Called once every checkpoint tensor is loaded (the weights sit on their device)."""
        return None

    def arena_weight(self, layer: Linear) -> bool:
        """Whether the weight as created is the memory the kernel keeps (packed in
        place), so it may be a slot of the weight arena (layers/weight_arena.py)."""
        return False

    def takes_blocks(self, tensor: BlockTensor | SavedQuantTensor) -> bool:
        """Whether load_weight takes this block-quantized (GGUF) or saved-quantized
        tensor as it is (otherwise the layer dequantizes it first)."""
        return False

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> x W^T + b, [..., out]."""

    def apply_silu_mul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a layer whose outputs are [gate | up]: [..., out / 2]."""
        return silu_and_mul(self.apply(layer, x))

    def embedding(self, layer: Linear, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the [out, in] matrix: a tied LM head doubles as the token embedding."""
        return layer.weight.index_select(0, token_ids)

    def checkpoint_weight(self, layer: Linear) -> torch.Tensor:
        """The weight in the checkpoint layout [out, in] (for saving)."""
        return layer.weight.detach()

    def weight_bytes(self, layer: Linear) -> int:
        """Bytes this layer's weight occupies in every form the method keeps."""
        return layer.weight.numel() * layer.weight.element_size()


def _copy_checked(dest: torch.Tensor, tensor: torch.Tensor) -> None:
    if dest.shape != tensor.shape:
        raise ValueError(f"shape {tuple(tensor.shape)} does not fit {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(tensor)


class PlainLinearMethod(LinearMethod):
    """The checkpoint layout [out, in] and `F.linear`: every device, autograd included."""

    name = "plain"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class TransposedLinearMethod(LinearMethod):
    """The weight stored [in, out] and multiplied as `x @ W`.

    On CPU, one-row products (batch-1 decode) with a wide matrix (out > in: fused QKV,
    gate/up, the LM head) stream the weight about 1.7x as fast this way as through
    `F.linear` on [out, in] (benchmarks/bench_linear_layout.py), while tall matrices
    (down_proj) are faster in the checkpoint layout. Numerics are unchanged.
    """

    name = "transposed"

    def create_weights(self, layer: Linear) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.in_features, layer.out_features))

    def load_weight(self, layer: Linear, tensor: torch.Tensor, rows: slice) -> None:
        _copy_checked(layer.weight[:, rows], tensor.t())

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = x @ layer.weight
        return out + layer.bias if layer.bias is not None else out

    def embedding(self, layer: Linear, token_ids: torch.Tensor) -> torch.Tensor:
        return layer.weight.index_select(1, token_ids).t()

    def checkpoint_weight(self, layer: Linear) -> torch.Tensor:
        return layer.weight.detach().t()


PLAIN = PlainLinearMethod()
TRANSPOSED = TransposedLinearMethod()
