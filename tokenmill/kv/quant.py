"""Per-token, per-KV-head symmetric quantization of K/V (no calibration).

A token's K (or V) row for one KV head, x[D], is stored as q = x / s with
s = absmax(x) / qmax, so the largest element lands on the edge of the code range:
int8 rounds to [-127, 127]; fp8 (e4m3fn) casts to the nearest representable value,
clamped to its finite range of +-448 (a cast does not saturate by itself: 449 -> NaN).
Dequantization is q * s in the compute dtype.
"""

from __future__ import annotations

import functools

import torch

# kv_cache_dtype (config value) -> storage dtype; "auto" stores in the model's dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
# Largest code magnitude per storage dtype.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32
# Keeps an all-zero row finite: its scale becomes tiny rather than 0 (0/0 = NaN).
_MIN_SCALE = 1e-12
_SATURATE = 2.0**126


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    quantized = KV_CACHE_DTYPES[kv_cache_dtype]
    return model_dtype if quantized is None else quantized


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] in dtype, scales [...] float32), one scale per row."""
    qmax = QMAX[dtype]
    x32 = x.float()
    # An overflowed activation (inf, or near float32's maximum) saturates at a value
    # whose dequantisation codes * scale cannot round up to inf again.
    x32 = torch.nan_to_num(x32, nan=0.0).clamp(-_SATURATE, _SATURATE)
    scale = (x32.abs().amax(dim=-1) / qmax).clamp_min(_MIN_SCALE)
    scaled = (x32 / scale.unsqueeze(-1)).clamp(-qmax, qmax)
    if dtype == torch.int8:
        scaled = scaled.round()
    return scaled.to(dtype), scale.to(SCALE_DTYPE)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D], scales [...] -> values [..., D] in dtype."""
    # In place after the cast: one full-size output, not two (on CPU each fresh
    # tensor of this size costs page faults comparable to the arithmetic).
    return codes_to(codes, dtype).mul_(scale.unsqueeze(-1).to(dtype))


def codes_to(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The codes' values in dtype (exact: every int8 and e4m3 value is representable)."""
    if codes.dtype == torch.float8_e4m3fn and codes.device.type == "cpu":
        # The CPU float8 cast runs element by element in software; looking the 256
        # possible bytes up in a table measured ~4x faster.
        table = _fp8_table(dtype)
        flat = codes.view(torch.uint8).reshape(-1).to(torch.int32)
        return table.index_select(0, flat).view(codes.shape)
    return codes.to(dtype)


@functools.cache
def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """Value of each e4m3fn byte 0..255 in dtype."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(dtype)
