"""Early exit for decode tokens (CALM-style confidence exits, state propagation).

After `layer` decoder layers, each decode token's hidden state goes through the final
norm and the (shared) LM head; a token whose most likely next token has probability
above `threshold` exits: its hidden state is frozen and is what the remaining layers
see of it, so their K/V for the token are computed from the exit state (CALM's
"propagate the exit hidden state"), and its logits are the exit layer's. Later tokens
attend to those K/V, so a sequence stays consistent whichever of its tokens exited.

When every token of a step exits, the remaining layers only compute and write K/V
(norm, QKV projection, rotary): no attention, no MLP. That is where the speed comes
from; a step in which some tokens exit and some do not runs every layer in full (the
exited tokens' states reset after each one). Only steps of plain decode tokens are
eligible (no prefill chunk, no speculative rows): the runner decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.base import AttentionContext
from tokenmill.layers.rotary import apply_rotary


@dataclass
class EarlyExit:
    layer: int  # decoder layers run before the exit test
    threshold: float  # exit when the top probability exceeds it (1.0: never)
    # Decode tokens seen and exited, and steps whose every token exited.
    tokens: int = 0
    exited: int = 0
    whole_steps: int = 0


def forward_with_exits(model: torch.nn.Module, token_ids: torch.Tensor,
                       positions: torch.Tensor, attention: AttentionContext,
                       exits: EarlyExit) -> torch.Tensor:
    """Final hidden states [T, hidden] of a step of T decode tokens."""
    inner = model.model
    hidden = model.embed(token_ids)
    rope = inner.rotary(positions, hidden.dtype)
    frozen = exited = None
    for index, layer in enumerate(inner.layers):
        if exited is not None and bool(exited.all()):
            _write_kv_only(layer, rope, frozen, attention)
            continue
        hidden = layer(rope, hidden, attention)
        if exited is not None and bool(exited.any()):
            hidden = torch.where(exited[:, None], frozen, hidden)
        if index + 1 == exits.layer:
            probs = model.compute_logits(inner.norm(hidden)).softmax(dim=-1)
            exited = probs.amax(dim=-1) > exits.threshold
            frozen = hidden.clone()
            exits.tokens += len(exited)
            exits.exited += int(exited.sum())
            exits.whole_steps += bool(exited.all())
    return inner.norm(frozen if exited is not None and bool(exited.all()) else hidden)


def _write_kv_only(layer: torch.nn.Module, rope: tuple[torch.Tensor, torch.Tensor],
                   hidden: torch.Tensor, attention: AttentionContext) -> None:
    attn = layer.self_attn
    num_tokens = hidden.shape[0]
    qkv = attn.qkv_proj(layer.input_layernorm(hidden))
    _, k, v = qkv.split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
    k = k.view(num_tokens, attn.num_kv_heads, attn.head_dim)
    v = v.view(num_tokens, attn.num_kv_heads, attn.head_dim)
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    attention.write(attn.layer_index, apply_rotary(k, rope), v.contiguous())
