"""Mixtral: the Llama decoder with a sparse mixture-of-experts MLP (softmax router,
top-k experts, renormalised weights)."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import cpu_blas
from tokenmill.layers.linear import Linear
from tokenmill.model.arch import ArchConfig
from tokenmill.model.llama import LlamaForCausalLM

# Checkpoint expert projections: w1 = gate, w3 = up (fused as gate_up), w2 = down.
_EXPERT = re.compile(r"experts\.(\d+)\.(w1|w2|w3)\.weight")


class SparseMoE(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.num_experts = arch.num_experts
        self.top_k = arch.num_experts_per_tok
        self.intermediate_size = arch.intermediate_size
        self.gate = Linear(arch.hidden_size, arch.num_experts, False)
        self.gate_up = nn.Parameter(torch.empty(arch.num_experts, 2 * arch.intermediate_size,
                                                arch.hidden_size))
        self.down = nn.Parameter(torch.empty(arch.num_experts, arch.hidden_size,
                                             arch.intermediate_size))
        # Tokens routed to each expert since the last reset (expert-load statistics).
        self.register_buffer("expert_load", torch.zeros(arch.num_experts, dtype=torch.int64),
                             persistent=False)
        # Per expert (gate_up, down) for the CPU products (cpu_blas.attach): oneDNN's
        # packed copies, or NumPy views [in, out].
        self.packed_weights: list[tuple] | None = None
        self.blas_weights: list[tuple] | None = None

    def use_cpu_products(self, kind: str) -> None:
        if self.packed_weights is not None or self.blas_weights is not None:
            return
        prepare = cpu_blas.onednn_weight if kind == "onednn" else cpu_blas.numpy_weight
        weights = [(prepare(self.gate_up[e], transposed=False),
                    prepare(self.down[e], transposed=False)) for e in range(self.num_experts)]
        if kind == "onednn":
            self.packed_weights = weights
            # Inference only from here: one copy of the experts, the packed one.
            self.gate_up.data = self.gate_up.data.new_empty(0)
            self.down.data = self.down.data.new_empty(0)
        else:
            self.blas_weights = weights

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weights is not None:
            gate_up, down = self.packed_weights[expert]
            gate, up = cpu_blas.onednn_linear(x, gate_up).chunk(2, dim=-1)
            return cpu_blas.onednn_linear(F.silu(gate) * up, down)
        if self.blas_weights is not None and not torch.is_grad_enabled():
            gate_up, down = self.blas_weights[expert]
            gate, up = cpu_blas.matmul(x, gate_up).chunk(2, dim=-1)
            return cpu_blas.matmul(F.silu(gate) * up, down)
        gate, up = F.linear(x, self.gate_up[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down[expert])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) for each token."""
        probs = self.gate(x).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        return (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts)
        self.expert_load += counts
        out = torch.zeros_like(x)
        # Experts in ascending order, tokens in order: the same summation order as the
        # reference implementation, so results match it exactly.
        for expert in counts.nonzero().flatten().tolist():
            tokens, slot = (experts == expert).nonzero(as_tuple=True)
            hidden = self._expert(expert, x[tokens])
            out.index_add_(0, tokens, hidden * weights[tokens, slot, None])
        return out

    @torch.no_grad()
    def load_checkpoint_tensor(self, module_name: str, param: str, tensor: torch.Tensor) -> str:
        """Place one checkpoint tensor; returns the name expected_checkpoint_tensors uses."""
        if param in ("experts.gate_up_proj", "experts.down_proj"):  # transformers 5 layout
            fused = param.removeprefix("experts.").removesuffix("_proj")
            getattr(self, fused).copy_(tensor)
            return f"{module_name}.{param}"
        match = _EXPERT.fullmatch(param)
        if match is None:
            raise ValueError(f"unknown expert tensor {param!r}")
        expert, which = int(match.group(1)), match.group(2)
        size = self.intermediate_size
        if which == "w2":
            self.down[expert].copy_(tensor)
        else:
            rows = slice(0, size) if which == "w1" else slice(size, 2 * size)
            self.gate_up[expert, rows].copy_(tensor)
        return f"{module_name}.experts.{expert}.{which}"

    def expected_checkpoint_tensors(self, module_name: str) -> set[str]:
        return {f"{module_name}.experts.{e}.{w}" for e in range(self.num_experts)
                for w in ("w1", "w2", "w3")}


class MixtralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def build_mlp(arch: ArchConfig, transpose_wide: bool) -> nn.Module:
        if arch.num_experts < 1 or not 1 <= arch.num_experts_per_tok <= arch.num_experts:
            raise ValueError("Mixtral config needs num_local_experts >= 1 and "
                             "1 <= num_experts_per_tok <= num_local_experts")
        return SparseMoE(arch)

    @staticmethod
    def rename_checkpoint_tensor(name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")
