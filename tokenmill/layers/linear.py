"""A linear layer whose weight form and kernel are a `LinearMethod` (layers/linear_method.py).

Models build `Linear(in, out, bias)` and know nothing of layouts or kernels: a layer
starts on the plain checkpoint layout (what training and tests use), and the loader
binds each layer's method (`bind_linear_methods`) before the weights are
materialised, then finalizes them once the checkpoint is in (`finalize_linear_methods`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.layers.block_tensor import BlockTensor
from tokenmill.layers.linear_method import PLAIN, LinearMethod
from tokenmill.layers.quantized_tensor import SavedQuantTensor

# (qualified module name, layer) -> the method that layer uses.
LinearSelector = Callable[[str, "Linear"], LinearMethod]


# How tensor parallelism splits a layer (dist/tensor_parallel.py): "column" splits the
# outputs, "row" the inputs (the partial products are summed by an all-reduce),
# "row_partial" like row but the caller reduces, "vocab" splits the outputs of an LM
# head over the vocabulary (they are gathered); None: every rank holds it whole.
PARALLEL_STYLES = (None, "column", "row", "row_partial", "vocab")


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 parallel: str | None = None) -> None:
        super().__init__()
        if parallel not in PARALLEL_STYLES:
            raise ValueError(f"parallel must be one of {PARALLEL_STYLES}, got {parallel!r}")
        self.in_features = in_features
        self.out_features = out_features
        # Sizes are this rank's share when the model is built for a tensor-parallel rank.
        self.parallel = parallel
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # Whether the plain weight is read for more than products (a tied LM head is
        # also the embedding table): methods that repack the weight keep it then.
        self.keep_weight = False
        # Whether weight quantization may take this layer (a MoE router's scores pick
        # experts: it stays exact).
        self.quantizable = True
        self.method: LinearMethod = PLAIN
        self.method.create_weights(self)

    def set_method(self, method: LinearMethod) -> None:
        """Switch to `method` before weights are loaded (its parameters replace the old)."""
        if method is self.method:
            return
        del self.weight
        self.method = method
        method.create_weights(self)

    def forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """x W^T + b; with `silu_mul` (a gated MLP's fused projection, outputs [gate | up])
        silu(gate) * up of it, in one pass where the method fuses the activation into
        its product. Either way through the module's call, so hooks see the layer."""
        if silu_mul:
            return self.method.apply_silu_mul(self, x)
        return self.method.apply(self, x)

    def load(self, name: str, tensor: torch.Tensor | BlockTensor | SavedQuantTensor,
             rows: slice | None = None) -> None:
        """Copy a checkpoint tensor (weight [out, in] or bias [out]) into the output rows
        `rows` (all when None) of this layer; a block-quantized or saved-quantized weight
        is dequantized unless the method keeps its format."""
        rows = rows or slice(0, self.out_features)
        if name == "bias":
            self.method.load_bias(self, tensor, rows)
        else:
            if (isinstance(tensor, (BlockTensor, SavedQuantTensor))
                    and not self.method.takes_blocks(tensor)):
                tensor = tensor.dequantize()
            self.method.load_weight(self, tensor, rows)

    def reload(self, weight: torch.Tensor) -> None:
        """Replace the whole weight with a checkpoint-layout [out, in] tensor and rebuild
        the method's kernel form (an expert copy moved between ranks)."""
        dtype, device = weight.dtype, weight.device
        self.method.create_weights(self)
        self.weight.data = self.weight.data.to(dtype=dtype, device=device)
        self.method.load_weight(self, weight, slice(0, self.out_features))
        self.method.finalize(self)

    def embedding(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the [out, in] matrix: a tied LM head doubles as the token embedding."""
        return self.method.embedding(self, token_ids)

    def checkpoint_weight(self) -> torch.Tensor:
        return self.method.checkpoint_weight(self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, method={self.method.name}")


def bind_linear_methods(model: nn.Module, select: LinearSelector) -> None:
    """Give every Linear in `model` the method `select` picks for it (before loading)."""
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            module.set_method(select(name, module))


def finalize_linear_methods(model: nn.Module) -> None:
    """Let every Linear's method prepare its kernel form (after loading)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.finalize(module)


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes the Linear layers' weights occupy, in every form their methods keep."""
    return sum(module.method.weight_bytes(module) for module in model.modules()
               if isinstance(module, Linear))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter in `model`, Linear weights counted in every form their
    methods keep (a packed copy beside a tied embedding included)."""
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, Linear)}
    others = sum(p.numel() * p.element_size() for p in model.parameters()
                 if id(p) not in linear_weights)
    return others + linear_weight_bytes(model)
