"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 decoder with `layers/moe.py`'s sparse MLP,
each expert moe_intermediate_size wide; Qwen2-MoE adds a shared expert behind a sigmoid
gate and keeps the softmax's top-k weights unless norm_topk_prob; layers listed in
mlp_only_layers (or off the decoder_sparse_step) keep a dense MLP."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.layers.moe import SparseMoE
from tokenmill.model.arch import ArchConfig
from tokenmill.model.llama import GatedMLP, LlamaForCausalLM
from tokenmill.model.mixtral import split_fused_experts


class QwenMoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def build_mlp(arch: ArchConfig, layer: int = 0) -> nn.Module:
        if not arch.is_sparse(layer):
            return GatedMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias)
        return SparseMoE(arch.hidden_size, arch.moe_intermediate_size or arch.intermediate_size,
                         arch.num_experts, arch.num_experts_per_tok, arch.norm_topk_prob,
                         arch.shared_expert_intermediate_size, arch.expert_slots)

    @staticmethod
    def split_checkpoint_tensor(name: str, tensor: torch.Tensor
                                ) -> Iterable[tuple[str, torch.Tensor]]:
        return split_fused_experts(name, tensor, ("gate_proj", "up_proj", "down_proj"))
