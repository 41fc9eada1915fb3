"""Mixtral: the Llama decoder with a sparse mixture-of-experts MLP (`layers/moe.py`:
softmax router, top-k experts, renormalised weights). This file only maps Mixtral's
checkpoint names onto that layer."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.layers.moe import SparseMoE
from tokenmill.model.arch import ArchConfig
from tokenmill.model.llama import STACKED_PARAMS, LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    # Expert projections: w1 = gate, w3 = up (fused as gate_up_proj), w2 = down_proj.
    STACKED_PARAMS = {**STACKED_PARAMS, "w1": ("gate_up_proj", "gate"),
                      "w3": ("gate_up_proj", "up")}

    @staticmethod
    def build_mlp(arch: ArchConfig, layer: int = 0) -> nn.Module:
        return SparseMoE(arch.hidden_size, arch.moe_intermediate_size or arch.intermediate_size,
                         arch.num_experts, arch.num_experts_per_tok,
                         expert_slots=arch.expert_slots)

    @staticmethod
    def rename_checkpoint_tensor(name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.").replace(".w2.", ".down_proj.")

    @staticmethod
    def split_checkpoint_tensor(name: str, tensor: torch.Tensor
                                ) -> Iterable[tuple[str, torch.Tensor]]:
        return split_fused_experts(name, tensor, ("w1", "w3", "w2"))


def split_fused_experts(name: str, tensor: torch.Tensor, names: tuple[str, str, str]
                        ) -> Iterable[tuple[str, torch.Tensor]]:
    """transformers 5 stores each layer's experts fused, [E, 2I, H] gate/up and
    [E, H, I] down: split them into per-expert tensors named `names` (gate, up,
    down) as the family's original checkpoints name them."""
    owner, _, param = name.rpartition(".")
    if not owner.endswith(".experts") or param not in ("gate_up_proj", "down_proj"):
        yield name, tensor
        return
    gate, up, down = names
    for expert in range(tensor.shape[0]):
        if param == "down_proj":
            yield f"{owner}.{expert}.{down}.weight", tensor[expert]
        else:
            half = tensor.shape[1] // 2
            yield f"{owner}.{expert}.{gate}.weight", tensor[expert, :half]
            yield f"{owner}.{expert}.{up}.weight", tensor[expert, half:]
