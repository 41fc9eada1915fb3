"""Hot-expert replicas in a serving engine: which rank computes each (token, expert)
pair, and moving expert weights between ranks when the copies are re-planned.

Each MoE layer under expert parallelism with `--expert-redundant-slots R` holds
(E + R) / ranks expert slots per rank. `ExpertReplicas` keeps the layer's placement
(dist/eplb.py's `plan_replicas`), what each rank's slots hold, and a `Router` that
picks a copy for every pair. Every rank computes the same decisions from the same
inputs: the router's state changes only with the tokens it routes and with
`rebalance`, which the engine orders on the same step for all ranks, from global
expert counts.

`rebalance` re-plans the copies from the last window's mean load per step, and adopts
the new plan only if it cuts the busiest rank's planned load by at least `min_gain`
(`--expert-replan-min-gain`; otherwise only the router's estimate is refreshed): planning from scratch reshuffles
experts between ranks on every small change of load, and each move costs a transfer
and a kernel rebuild. A rank keeps the experts it still holds in their slots; a slot given a new expert receives
its weights from the lowest rank that held it, in one all-to-all of flat float
weights, and rebuilds its kernel form (`Linear.reload`). Copies are exact: a moved
expert computes what its source did.
"""

from __future__ import annotations

import torch

from tokenmill.dist.eplb import Placement, Router, plan_replicas
from tokenmill.layers.moe import SparseMoE


def slot_experts(placement: Placement, previous: list[list[int]] | None = None
                 ) -> list[list[int]]:
    """Each rank's slots -> the expert it holds: a rank keeps an expert it held in the
    slot it had (previous), new experts fill the freed slots in ascending order."""
    wanted = [sorted(e for e, ranks in enumerate(placement.copies) for r in ranks if r == rank)
              for rank in range(placement.num_ranks)]
    if previous is None:
        return wanted
    out = []
    for rank, want in enumerate(wanted):
        slots: list[int | None] = [None] * placement.slots_per_rank
        left = list(want)
        for slot, expert in enumerate(previous[rank]):
            if expert in left:
                slots[slot] = expert
                left.remove(expert)
        fill = iter(left)
        out.append([e if e is not None else next(fill) for e in slots])
    return out


def plan_moves(old: list[list[int]], new: list[list[int]]) -> list[tuple[int, int, int, int]]:
    """(destination rank, slot, source rank, source slot) for every slot whose expert
    changes: the source is the lowest rank that held the expert."""
    moves = []
    for rank, slots in enumerate(new):
        for slot, expert in enumerate(slots):
            if old[rank][slot] == expert:
                continue
            source = next(r for r in range(len(old)) if expert in old[r])
            moves.append((rank, slot, source, old[source].index(expert)))
    return moves


class ExpertReplicas:
    """One MoE layer's copies on an expert-parallel group (rank `rank` of `size`)."""

    def __init__(self, num_experts: int, size: int, rank: int, redundant: int,
                 policy: str, min_gain: float = 0.05) -> None:
        self.num_experts, self.size, self.rank = num_experts, size, rank
        self.redundant, self.policy, self.min_gain = redundant, policy, min_gain
        # Uniform load until one is measured: the first copies go to experts 0, 1, ...
        self.placement = plan_replicas([1.0] * num_experts, size, redundant)
        self.slots = slot_experts(self.placement)
        self.router = Router(self.placement, policy, ranks_per_node=size)
        self.window_load = [0] * num_experts
        self.window_steps = 0
        self.moves = 0  # expert copies moved since start-up

    @property
    def local_slots(self) -> tuple[int, ...]:
        return tuple(self.slots[self.rank])

    def record(self, counts: list[int]) -> None:
        """One step's global tokens per expert (the load the next plan balances)."""
        self.window_load = [a + b for a, b in zip(self.window_load, counts, strict=True)]
        self.window_steps += 1

    def destinations(self, experts: torch.Tensor, sources: torch.Tensor | None) -> torch.Tensor:
        """The rank computing each (token, k) pair of `experts` [T, k]. sources [T]: the
        rank each token comes from (None: this rank's own tokens)."""
        flat = experts.flatten()
        top_k = experts.shape[1] if experts.dim() > 1 else 1
        origin = (sources.repeat_interleave(top_k) if sources is not None
                  else torch.full_like(flat, self.rank))
        dest = torch.empty_like(flat)
        router, base = self.router, list(self.router.estimate)
        for expert in torch.unique(flat).tolist():
            (pairs,) = (flat == expert).nonzero(as_tuple=True)
            for source in torch.unique(origin[pairs]).tolist():
                part = pairs[origin[pairs] == source]
                start = 0
                for rank, count in router.route(expert, len(part), source).items():
                    dest[part[start:start + count]] = rank
                    router.charge(rank, count)
                    start += count
        router.estimate = base  # the charges were this step's, not the window's
        return dest.view_as(experts)

    def rebalance(self, moe: SparseMoE) -> int:
        """Re-plan from the window's load, move the weights that change (a collective:
        every rank calls it on the same step); returns the copies moved."""
        if not self.window_steps:
            return 0
        loads = [tokens / self.window_steps for tokens in self.window_load]
        self.window_load, self.window_steps = [0] * self.num_experts, 0
        placement = plan_replicas(loads, self.size, self.redundant)
        if max(placement.rank_loads(loads)) > (1 - self.min_gain) * max(
                self.placement.rank_loads(loads)):
            self.router.refresh(self.placement.rank_loads(loads))
            return 0
        slots = slot_experts(placement, self.slots)
        moves = plan_moves(self.slots, slots)
        if moves:
            _move_weights(moe, moves, self.rank, self.size)
        self.placement, self.slots = placement, slots
        moe.set_slots(self.local_slots)
        self.router.placement = placement  # round-robin goes on where it was
        self.router.refresh(placement.rank_loads(loads))
        self.moves += len(moves)
        return len(moves)


def _move_weights(moe: SparseMoE, moves: list[tuple[int, int, int, int]], rank: int,
                  size: int) -> None:
    """One all-to-all: each source sends the flat float weights of the experts others
    need, in (destination, slot) order; destinations reload them into their slots."""
    outgoing = sorted((d, s, src_slot) for d, s, src, src_slot in moves
                      if src == rank and d != rank)
    incoming = sorted((src, s, src_slot) for d, s, src, src_slot in moves
                      if d == rank and src != rank)
    local = [(s, src_slot) for d, s, src, src_slot in moves if d == rank == src]
    sample = moe.experts[0].flat_weights()
    per_expert = sample.numel()
    send_splits = [per_expert * sum(1 for d, _, _ in outgoing if d == r) for r in range(size)]
    receive_splits = [per_expert * sum(1 for s, _, _ in incoming if s == r) for r in range(size)]
    send = (torch.cat([moe.experts[slot].flat_weights() for _, _, slot in outgoing])
            if outgoing else sample.new_empty(0))
    received = sample.new_empty(sum(receive_splits))
    moe.group.all_to_all(received, send, receive_splits, send_splits)
    copies = {slot: moe.experts[src_slot].flat_weights().clone() for slot, src_slot in local}
    for index, (_, slot, _) in enumerate(incoming):
        moe.experts[slot].load_flat_weights(received[index * per_expert:(index + 1) * per_expert])
    for slot, weights in copies.items():
        moe.experts[slot].load_flat_weights(weights)


class ReplicaSet:
    """Every MoE layer's replicas on this rank: the worker's one handle on them."""

    def __init__(self, num_experts: int, group, redundant: int, policy: str,
                 min_gain: float = 0.05) -> None:
        self.group = group
        self.num_experts, self.redundant, self.policy = num_experts, redundant, policy
        self.min_gain = min_gain
        self.layers: list[tuple[SparseMoE, ExpertReplicas]] = []
        probe = ExpertReplicas(num_experts, group.size, group.rank, redundant, policy)
        # What this rank loads at start-up (every layer starts from the same plan).
        self.initial_slots = probe.local_slots
        self.rebalances = 0

    def attach(self, layers: list[SparseMoE]) -> None:
        for moe in layers:
            replicas = ExpertReplicas(self.num_experts, self.group.size, self.group.rank,
                                      self.redundant, self.policy, self.min_gain)
            moe.replicas = replicas
            self.layers.append((moe, replicas))

    def record(self, counts: list[list[int]]) -> None:
        """One step's global tokens per layer per expert."""
        for (_, replicas), layer in zip(self.layers, counts, strict=True):
            replicas.record(layer)

    def rebalance(self) -> int:
        """Re-plan every layer from its window (a collective); the copies moved."""
        self.rebalances += 1
        return sum(replicas.rebalance(moe) for moe, replicas in self.layers)

    def take_rank_load(self) -> list[list[int]]:
        """(token, expert) pairs each rank computed per layer since the last call."""
        counts = torch.stack([moe.rank_load if moe.rank_load is not None
                              else torch.zeros(self.group.size, dtype=torch.int64)
                              for moe, _ in self.layers])
        for moe, _ in self.layers:
            moe.rank_load = None
        if self.layers and self.layers[0][0].all_to_all:  # each rank counted its own sends
            self.group.all_reduce(counts)
        return counts.tolist()
