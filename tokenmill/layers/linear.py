"""Linear layers whose weight layout is chosen for speed on the device at hand.

Checkpoints store a weight as [out, in]. On CPU, one-row products (batch-1 decode)
with a wide matrix (out > in: fused QKV, gate/up, the LM head) stream the weight
about 1.7x as fast when it is stored [in, out] and multiplied as `x @ W` than through
`F.linear` on [out, in] (measured: benchmarks/bench_linear_layout.py), while tall
matrices (down_proj) are faster in the checkpoint layout. The layout is fixed at
construction; loading transposes checkpoint tensors as they are copied in.

With float32 on the CPU the engine routes products through oneDNN on a packed copy of
the weight, or NumPy's OpenBLAS on a zero-copy [in, out] view (`cpu_blas.attach`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import cpu_blas


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 transposed: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.transposed = transposed
        shape = (in_features, out_features) if transposed else (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # Set by cpu_blas.attach: oneDNN's packed copy of the weight, or a NumPy view
        # [in, out] of it for NumPy's BLAS; used without autograd (and the packed copy
        # always, once the plain weight is freed).
        self.packed_weight: torch.Tensor | None = None
        self.blas_weight: np.ndarray | None = None
        # Whether the plain weight is read for more than products (a tied LM head is
        # also the embedding table); otherwise packing frees it.
        self.keep_weight = False

    def use_cpu_products(self, kind: str) -> None:
        if self.packed_weight is not None or self.blas_weight is not None:
            return  # shared with a model attached before
        if kind == "onednn":
            self.packed_weight = cpu_blas.onednn_weight(self.weight, self.transposed)
            if not self.keep_weight:
                # Inference only from here: one copy of the weight, the packed one.
                self.weight.data = self.weight.data.new_empty(0)
        else:
            self.blas_weight = cpu_blas.numpy_weight(self.weight, self.transposed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None and (not torch.is_grad_enabled()
                                               or self.weight.numel() == 0):
            return cpu_blas.onednn_linear(x, self.packed_weight, self.bias)
        if self.blas_weight is not None and not torch.is_grad_enabled():
            out = cpu_blas.matmul(x, self.blas_weight)
            return out + self.bias if self.bias is not None else out
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        out = x @ self.weight
        return out + self.bias if self.bias is not None else out

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, rows: slice | None = None) -> None:
        """Copy a checkpoint tensor (weight [out, in] or bias [out]) into the output rows
        `rows` (all when None) of this layer's parameter."""
        rows = rows or slice(0, self.out_features)
        if name == "bias":
            dest = self.bias[rows]
        elif self.transposed:
            dest, tensor = self.weight[:, rows], tensor.t()
        else:
            dest = self.weight[rows]
        if dest.shape != tensor.shape:
            raise ValueError(f"shape {tuple(tensor.shape)} does not fit {tuple(dest.shape)}")
        dest.copy_(tensor)

    def embedding(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the [out, in] matrix: a tied LM head doubles as the token embedding."""
        if self.transposed:
            return self.weight.index_select(1, token_ids).t()
        return self.weight.index_select(0, token_ids)


def wide(in_features: int, out_features: int, transpose_wide: bool) -> bool:
    """Whether a layer of this shape takes the transposed layout."""
    return transpose_wide and out_features > in_features
