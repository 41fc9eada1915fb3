"""Plain causal attention over equal-length windows, without a KV cache.

The flattened batch is `num_windows` windows of `window` tokens each. Used to train
decoder layers teacher-forced (the EAGLE head) and as the from-scratch reference for
their paged path; not a serving backend (it keeps no cache), so not registered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.base import AttentionBackend, AttentionContext, AttentionSpec, BatchLayout
from tokenmill.kv import KVCache


class WindowCausalAttention(AttentionBackend):
    name = "window-causal"

    def __init__(self, window: int, spec: AttentionSpec | None = None) -> None:
        super().__init__(spec)
        self.window = window

    def build_metadata(self, layout: BatchLayout) -> None:
        return None

    def forward(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache | None, metadata: None, scale: float) -> torch.Tensor:
        def windows(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, window, D]
            return x.view(-1, self.window, *x.shape[1:]).transpose(1, 2)

        out = F.scaled_dot_product_attention(windows(q), windows(k), windows(v),
                                             is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape)


def window_attention(window: int) -> AttentionContext:
    """The context a model's forward takes to run windows of `window` tokens."""
    return AttentionContext(WindowCausalAttention(window), None, None)
