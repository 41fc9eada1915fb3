"""EAGLE-1 draft head (Li et al., ICML 2024): feature-level autoregression on the
target's own hidden states. The proposer that drafts with it is `proposer.py`, its
file format `checkpoint.py`.

The head. Position t takes the pair (f_t, x_{t+1}): f_t is the target's feature at
position t (its final hidden state *after* the final norm, which is what
`LlamaForCausalLM.forward` returns and what the LM head reads), x_{t+1} the token
that follows. Then

    f_hat_{t+1} = DecoderLayer(FC([f_t ; embed(x_{t+1})]))

and the target's own LM head (shared, not stored with the head) turns f_hat_{t+1}
into logits for x_{t+2}. Knowing x_{t+1} removes the sampling uncertainty that makes
plain feature regression ambiguous. Details chosen here:
- the FC (2h -> h) has a bias, as in EAGLE-1;
- the decoder layer is tokenmill's `DecoderLayer` with the target's attention
  geometry and MLP width, unchanged: it keeps its input RMSNorm (EAGLE-1 drops it
  in layer 0 because its input is an un-normalised residual; here the FC output's
  scale is free, and normalising it keeps training stable);
- no final norm: the head regresses post-norm features directly, so its output is
  already at the scale the LM head expects;
- rotary positions are the target's absolute positions (position of f_t).
"""


from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tokenmill.attention.base import AttentionContext
from tokenmill.attention.window import window_attention
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.model.arch import ArchConfig
from tokenmill.model.llama import DecoderLayer, LlamaForCausalLM

INIT_STD = 0.02


def head_arch(target_arch: ArchConfig) -> ArchConfig:
    """The head's architecture: the target's geometry, one dense decoder layer."""
    return dataclasses.replace(target_arch, num_layers=1, num_experts=0, num_experts_per_tok=0)


class EagleHead(nn.Module):
    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        hidden = arch.hidden_size
        self.fc = Linear(2 * hidden, hidden, bias=True)
        self.layer = DecoderLayer(arch, LlamaForCausalLM.build_mlp(arch))
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope)
        self.rotary.build_cache()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Random initialisation (seed torch first): N(0, 0.02) matrices, zero biases,
        unit norm gains."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.weight.normal_(0.0, INIT_STD)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def place(self, device: torch.device, dtype: torch.dtype) -> EagleHead:
        """Move to device/dtype; the rotary tables stay float32 and are rebuilt there."""
        self.to(device=device, dtype=dtype)
        self.rotary.float()
        self.rotary.build_cache()
        return self

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor,
                positions: torch.Tensor, attention: AttentionContext) -> torch.Tensor:
        """Predicted next features [T, h] for T flattened pairs (f_t, embed(x_{t+1}))."""
        hidden = self.fc(torch.cat((features, token_embeds), dim=-1))
        rope = self.rotary(positions, hidden.dtype)
        return self.layer(rope, hidden, attention)

    def forward_windows(self, features: torch.Tensor, token_embeds: torch.Tensor,
                        first_position: int = 0) -> torch.Tensor:
        """Teacher-forced forward over [B, W, h] windows of pairs, each window starting
        at target position first_position; returns [B, W, h]."""
        batch, window, hidden = features.shape
        positions = torch.arange(first_position, first_position + window,
                                 device=features.device).repeat(batch)
        out = self(features.reshape(-1, hidden), token_embeds.reshape(-1, hidden), positions,
                   window_attention(window))
        return out.view(batch, window, hidden)
