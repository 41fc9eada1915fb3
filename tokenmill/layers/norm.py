"""RMSNorm computed in float32, as the reference implementations do.

On the CPU, in inference, a float32 row goes through one compiled call
(layers/csrc/row_ops.cpp: the same arithmetic, one operator instead of six, ~8-25 µs saved per
call at decode), and a residual add with the norm after it through one more
(add_and_norm); with autograd, on other devices or without a compiler, the torch form
runs."""

from __future__ import annotations

import torch

from tokenmill.layers.native import row_ops_for


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # the usual CPU case: no casts to dispatch
            ops = row_ops_for(x) if x.is_contiguous() else None
            if ops is not None:
                return ops.rms_norm(x, self.weight, self.eps)
            return self.weight * (x * x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_())
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, this norm of it): one compiled call where forward takes
        one (the sum rounds as torch's add)."""
        ops = (row_ops_for(residual, delta) if residual.shape == delta.shape
               and residual.is_contiguous() and delta.is_contiguous() else None)
        if ops is not None:
            return ops.add_rms_norm(residual, delta, self.weight, self.eps)
        total = residual + delta
        return total, self(total)
