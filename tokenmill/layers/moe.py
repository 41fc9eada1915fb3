"""A sparse mixture-of-experts MLP: a softmax router picks the top-k experts per token,
each expert is a gated MLP of `Linear` layers, so every expert runs through the same
linear methods as the dense projections (packed, quantized or sharded alike).

Under tensor parallelism every rank holds a column / row shard of every expert and the
layer's partial sums are reduced once. Under expert parallelism (`expert_slots`: the
experts this rank holds, whole) each rank holds E / p experts, or (E + R) / p with R
redundant copies of hot experts (`replicas`, dist/expert_replicas.py: which rank computes
each (token, expert) pair):

- tokens replicated on every rank (no sequence parallelism): each rank runs its own
  experts on the tokens routed to them and the partial outputs are summed, as under TP;
- tokens split over the ranks (sequence parallelism): each rank routes its own tokens
  and sends each (token, expert) pair's row to the expert's rank with one all-to-all,
  the experts run on what they received, and a second all-to-all brings the rows back
  to be weighted and summed where the token lives. No all-gather, no reduce.

Rows are summed in ascending expert order per token either way, as on one rank.
"""

from __future__ import annotations

import torch
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
        return self.down_proj(self.gate_up_proj(x, silu_mul=True))

    def flat_weights(self) -> torch.Tensor:
        """Both projections' checkpoint-layout weights, flattened into one tensor."""
        return torch.cat([self.gate_up_proj.checkpoint_weight().flatten(),
                          self.down_proj.checkpoint_weight().flatten()])

    def load_flat_weights(self, flat: torch.Tensor) -> None:
        """The inverse of flat_weights: take another copy's weights (kernels rebuilt)."""
        gate_up, down = self.gate_up_proj, self.down_proj
        first = gate_up.out_features * gate_up.in_features
        gate_up.reload(flat[:first].view(gate_up.out_features, gate_up.in_features))
        down.reload(flat[first:].view(down.out_features, down.in_features))


class SparseMoE(nn.Module):
    """norm_topk_prob: renormalise the top-k router weights to sum to 1 (Mixtral,
    Qwen3-MoE) or keep the softmax's (Qwen2-MoE's default). shared_intermediate_size:
    an expert every token goes through, scaled by a sigmoid gate (Qwen2-MoE)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int,
                 top_k: int, norm_topk_prob: bool = True,
                 shared_intermediate_size: int = 0,
                 expert_slots: tuple[int, ...] | None = None) -> None:
        super().__init__()
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError("a mixture of experts needs num_experts >= 1 and "
                             f"1 <= top_k <= num_experts, got {num_experts}, {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate = Linear(hidden_size, num_experts)
        # Router scores pick experts, and a tiny matrix saves nothing quantized.
        self.gate.quantizable = False
        # Expert parallelism: slot i of this rank holds expert expert_slots[i], whole.
        self.expert_parallel = expert_slots is not None
        self.experts = nn.ModuleList(Expert(hidden_size, intermediate_size)
                                     for _ in (expert_slots or range(num_experts)))
        # Expert replication swaps a routed expert's weights for another copy's
        # (load_flat_weights): kept out of the weight arena, whose slots would outlive
        # them (layers/weight_arena.py).
        self.experts.reloads_weights = True
        self.set_slots(tuple(expert_slots or range(num_experts)))
        # Replicated experts: the copy (rank) each pair goes to (dist/expert_replicas.py).
        self.replicas = None
        self.norm_topk_prob = norm_topk_prob
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            # Under TP its down projection's partial sums join the experts' in the one
            # reduce; under EP it is replicated.
            self.shared_expert = Expert(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1)
            self.shared_expert_gate.quantizable = False
        if self.expert_parallel:  # whole experts: no tensor-parallel split
            for module in self.modules():
                if isinstance(module, Linear):
                    module.parallel = None
        # The tensor-parallel group (the experts' down projections are reduced here).
        self.group: Collectives = SINGLE_RANK
        # Tokens routed to each expert since the last reset (expert-load statistics).
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64),
                             persistent=False)
        # With replicas: (token, expert) pairs each rank computed since the last reset.
        self.rank_load: torch.Tensor | None = None

    def set_slots(self, expert_slots: tuple[int, ...]) -> None:
        """What this rank's slots hold (the first slot of an expert held twice serves it)."""
        self.expert_slots = expert_slots
        self.slot_of: dict[int, int] = {}
        for slot, expert in enumerate(expert_slots):
            self.slot_of.setdefault(expert, slot)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) for each token."""
        probs = self.gate(x).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    @property
    def all_to_all(self) -> bool:
        """Whether this layer takes its rank's share of the tokens (EP under SP)."""
        return self.expert_parallel and getattr(self.group, "sequence_parallel", False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_to_all:
            return self._dispatch_combine(x)
        weights, experts = self.route(x)
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts)
        self.expert_load += counts
        dest = None
        if self.replicas is not None:  # every rank sees every token: homes by chunk
            homes = torch.arange(len(x)) * self.group.size // max(1, len(x))
            dest = self.replicas.destinations(experts, homes)
            self._count_ranks(dest)
        out = torch.zeros_like(x)
        # Experts in ascending order, tokens in order: the same summation order as the
        # reference implementation, so results match it exactly.
        for expert in counts.nonzero().flatten().tolist():
            local = self.slot_of.get(expert)
            if local is None:
                continue  # another rank's (expert parallelism)
            hit = experts == expert
            if dest is not None:  # this rank's copy serves only the pairs sent to it
                hit &= dest == self.group.rank
            tokens, slot = hit.nonzero(as_tuple=True)
            if not len(tokens):
                continue
            hidden = self.experts[local](x[tokens])
            out.index_add_(0, tokens, hidden * weights[tokens, slot, None])
        # Replicated under EP: one rank's copy counts in the sum.
        if self.shared_expert is not None and (not self.expert_parallel or self.group.rank == 0):
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.group.reduce_partial(out)

    def _dispatch_combine(self, x: torch.Tensor) -> torch.Tensor:
        """Expert parallelism on this rank's share of the tokens (zero-padded rows past
        the step's tokens are left out): all-to-all to the experts and back."""
        group = self.group
        valid = max(0, min(group.chunk, group.tokens - group.rank * group.chunk))
        out = torch.zeros_like(x)
        mine = x[:valid]
        weights, experts = self.route(mine)
        self.expert_load += torch.bincount(experts.flatten(), minlength=self.num_experts)
        # (token, slot) pairs by expert, then by destination rank (stable: each rank's
        # pairs stay in expert order).
        by_expert, pairs = torch.sort(experts.flatten(), stable=True)
        order = None  # without replicas, expert order is already destination order
        if self.replicas is not None:
            dest = self.replicas.destinations(experts, None).flatten()[pairs]
            self._count_ranks(dest)
            order = torch.sort(dest, stable=True).indices
            by_expert, dest = by_expert[order], dest[order]
        else:
            dest = by_expert // len(self.experts)  # contiguous blocks of experts
        sent = pairs if order is None else pairs[order]
        tokens = sent // self.top_k
        send = torch.bincount(dest, minlength=group.size)
        receive = torch.empty_like(send)
        group.all_to_all(receive, send, [1] * group.size, [1] * group.size)
        send_splits, receive_splits = send.tolist(), receive.tolist()
        rows = x.new_empty(sum(receive_splits), x.shape[1])
        group.all_to_all(rows, mine[tokens], receive_splits, send_splits)
        ids = by_expert.new_empty(sum(receive_splits))
        group.all_to_all(ids, by_expert, receive_splits, send_splits)
        result = torch.empty_like(rows)
        for expert, local in self.slot_of.items():
            (at,) = (ids == expert).nonzero(as_tuple=True)
            if len(at):
                result[at] = self.experts[local](rows[at])
        back = x.new_empty(len(tokens), x.shape[1])
        group.all_to_all(back, result, send_splits, receive_splits)
        if order is not None:  # back in expert order, whichever rank computed a pair
            in_order = torch.empty_like(back)
            in_order[order] = back
            back = in_order
        tokens, slots = pairs // self.top_k, pairs % self.top_k
        out[:valid].index_add_(0, tokens, back * weights[tokens, slots, None])
        if self.shared_expert is not None:
            out[:valid] += torch.sigmoid(self.shared_expert_gate(mine)) * self.shared_expert(mine)
        return out

    def _count_ranks(self, dest: torch.Tensor) -> None:
        counts = torch.bincount(dest.flatten(), minlength=self.group.size)
        self.rank_load = counts if self.rank_load is None else self.rank_load + counts
