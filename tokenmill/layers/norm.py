"""RMSNorm computed in float32, as the reference implementations do.

On the CPU, in inference, a float32 row goes through one compiled call
(csrc/rms_norm.cpp: the same arithmetic, one operator instead of six, ~30 µs saved per
call at decode); with autograd, on other devices or without a compiler, the torch form
runs."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tokenmill.layers.native import build_extension

SOURCE = Path(__file__).resolve().parent / "csrc" / "rms_norm.cpp"


@functools.cache
def native_norm():
    """The compiled kernel, or None where it cannot be built."""
    return build_extension("rms_norm", SOURCE)


def prepare_native_norm(device: torch.device, dtype: torch.dtype) -> None:
    """Build (or load) the kernel at start-up rather than in the first request."""
    if device.type == "cpu" and dtype == torch.float32:
        native_norm()


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # the usual CPU case: no casts to dispatch
            if (x.device.type == "cpu" and not torch.is_grad_enabled() and x.is_contiguous()
                    and native_norm() is not None):
                return native_norm().rms_norm(x, self.weight, self.eps)
            return self.weight * (x * x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_())
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
