"""RMSNorm computed in float32, as the reference implementations do."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # the usual CPU case: no casts to dispatch
            return self.weight * (x * x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_())
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
