"""Rotary position embeddings (non-interleaved halves, as in HF Llama), with scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from tokenmill.layers.native import row_ops_for

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inverse_frequencies(head_dim: int, rope: dict[str, Any]) -> torch.Tensor:
    """Per-pair rotation frequencies, adjusted by the checkpoint's rope scaling."""
    base = float(rope.get("rope_theta", 10000.0))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base ** exponents)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, rope)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported "
                     f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _llama3_frequencies(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth
    blend between the two bands."""
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original_len = float(rope["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    long_band = wavelength > original_len / low
    short_band = wavelength < original_len / high
    scaled = torch.where(long_band, inv_freq / factor, inv_freq)
    blend = (original_len / wavelength - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    return torch.where(~long_band & ~short_band, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_positions: int, rope: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope = dict(rope)
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2), persistent=False)

    @torch.no_grad()
    def build_cache(self) -> None:
        """Fill the cos/sin tables (after the module reaches its device)."""
        inv_freq = rope_inverse_frequencies(self.head_dim, self.rope).to(self.cos.device)
        positions = torch.arange(self.max_positions, device=self.cos.device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, shaped [T, 1, D/2] to broadcast over heads.
        Looked up once per step and shared by every layer."""
        # index_select, and no cast where the tables already hold dtype: the fewest
        # operators (each ~20 µs with the caches cold at a decode step's start).
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        if cos.dtype != dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate [T, heads, D] by the per-token angles (first half with second half)."""
    cos, sin = cos_sin
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """apply_rotary's result, computed in place in x by one compiled call where it can
    be (float32 on the CPU, inference, contiguous heads; bit-identical: row_ops.cpp)."""
    cos, sin = cos_sin
    ops = row_ops_for(x) if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else None
    if ops is not None:
        ops.rotate_(x, cos.reshape(x.shape[0], -1), sin.reshape(x.shape[0], -1))
        return x
    return apply_rotary(x, cos_sin)
