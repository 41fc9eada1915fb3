"""A sparse mixture-of-experts MLP: a softmax router picks the top-k experts per token,
each expert is a gated MLP of `Linear` layers, so every expert runs through the same
linear methods as the dense projections (packed, quantized or sharded alike)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.layers.parallel import SINGLE_RANK, Collectives


class Expert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, parallel="column")
        # Under tensor parallelism each expert's partial sums are reduced once, for the
        # whole layer (SparseMoE.forward), not once per expert.
        self.down_proj = Linear(intermediate_size, hidden_size, parallel="row_partial")

    def shard_slice(self, shard: str) -> slice:
        size = self.intermediate_size
        return slice(0, size) if shard == "gate" else slice(size, 2 * size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """norm_topk_prob: renormalise the top-k router weights to sum to 1 (Mixtral,
    Qwen3-MoE) or keep the softmax's (Qwen2-MoE's default). shared_intermediate_size:
    an expert every token goes through, scaled by a sigmoid gate (Qwen2-MoE)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int,
                 top_k: int, norm_topk_prob: bool = True,
                 shared_intermediate_size: int = 0) -> None:
        super().__init__()
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError("a mixture of experts needs num_experts >= 1 and "
                             f"1 <= top_k <= num_experts, got {num_experts}, {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate = Linear(hidden_size, num_experts)
        # Router scores pick experts, and a tiny matrix saves nothing quantized.
        self.gate.quantizable = False
        self.experts = nn.ModuleList(Expert(hidden_size, intermediate_size)
                                     for _ in range(num_experts))
        self.norm_topk_prob = norm_topk_prob
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            # Its down projection's partial sums join the experts' in the one reduce.
            self.shared_expert = Expert(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1)
            self.shared_expert_gate.quantizable = False
        # The tensor-parallel group (the experts' down projections are reduced here).
        self.group: Collectives = SINGLE_RANK
        # Tokens routed to each expert since the last reset (expert-load statistics).
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64),
                             persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) for each token."""
        probs = self.gate(x).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts)
        self.expert_load += counts
        out = torch.zeros_like(x)
        # Experts in ascending order, tokens in order: the same summation order as the
        # reference implementation, so results match it exactly.
        for expert in counts.nonzero().flatten().tolist():
            tokens, slot = (experts == expert).nonzero(as_tuple=True)
            hidden = self.experts[expert](x[tokens])
            out.index_add_(0, tokens, hidden * weights[tokens, slot, None])
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.group.reduce_partial(out)
