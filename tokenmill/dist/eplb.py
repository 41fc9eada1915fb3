"""Hot-expert replication (EPLB-style) and routing among replicas.

`plan_replicas` follows the two steps of DeepSeek's EPLB (expert-parallel load
balancer), written from its description: (1) give the redundant slots, one at a time,
to the expert with the highest load per copy, so the hottest experts get the most
copies; (2) pack the physical experts (each copy carrying load / copies) onto ranks,
heaviest first, each to the least-loaded rank that still has a free slot and no copy of
the same expert (balanced packing). EPLB also groups experts by node first; with one
node group this is the same.

`Router` picks, for each token of an expert, which copy serves it:

    round_robin   copies in turn, ignoring load (the "naive" replication)
    least_loaded  pieces of the tokens to whichever copy's rank carries the least
                  estimated load so far
    locality      the same among copies on the token's own rank, else on its node,
                  else among all copies (fewer peers per rank, less traffic)

The load-aware policies balance on an estimate: the ranks' mean load per step over the
last window, refreshed only every `window_s` seconds of the trace (0: every step; the
report recommends 100 ms), plus what this step has already sent.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("round_robin", "least_loaded", "locality")


@dataclass(frozen=True)
class Placement:
    """Which rank holds each copy of each expert: copies[e] = [rank, ...]."""

    copies: list[list[int]]
    num_ranks: int
    slots_per_rank: int

    def check(self) -> None:
        """ValueError unless every expert has a copy and no rank is over capacity."""
        held = [0] * self.num_ranks
        for expert, ranks in enumerate(self.copies):
            if not ranks:
                raise ValueError(f"expert {expert} has no copy")
            for rank in ranks:
                held[rank] += 1
        if max(held) > self.slots_per_rank:
            raise ValueError(f"a rank holds {max(held)} experts, over {self.slots_per_rank}")

    def rank_loads(self, loads: list[float]) -> list[float]:
        """Each rank's load when every copy takes an equal share of its expert's."""
        out = [0.0] * self.num_ranks
        for expert, ranks in enumerate(self.copies):
            for rank in ranks:
                out[rank] += loads[expert] / len(ranks)
        return out


def plan_without_replicas(num_experts: int, num_ranks: int) -> Placement:
    """Contiguous blocks, E / R experts per rank (what --expert-parallel runs)."""
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts do not split over {num_ranks} ranks")
    per_rank = num_experts // num_ranks
    return Placement([[e // per_rank] for e in range(num_experts)], num_ranks, per_rank)


def plan_replicas(loads: list[float], num_ranks: int, redundant: int) -> Placement:
    """EPLB's replicate-then-pack for `redundant` extra copies in all."""
    experts = len(loads)
    physical = experts + redundant
    if physical % num_ranks:
        raise ValueError(f"{experts} experts + {redundant} redundant slots do not fill "
                         f"{num_ranks} ranks evenly")
    slots = physical // num_ranks
    if redundant < 0 or slots > experts:
        raise ValueError("redundant slots must be >= 0 and leave each rank distinct experts")
    count = [1] * experts
    for _ in range(redundant):
        hottest = max(range(experts), key=lambda e: (loads[e] / count[e], -e))
        count[hottest] += 1
    items = sorted(((loads[e] / count[e], e) for e in range(experts) for _ in range(count[e])),
                   key=lambda item: (-item[0], item[1]))
    rank_load, rank_held = [0.0] * num_ranks, [0] * num_ranks
    copies: list[list[int]] = [[] for _ in range(experts)]
    for load, expert in items:
        open_ranks = [r for r in range(num_ranks) if rank_held[r] < slots]
        # Copies of one expert on distinct ranks where the slots allow it.
        free = [r for r in open_ranks if r not in copies[expert]] or open_ranks
        rank = min(free, key=lambda r: (rank_load[r], r))
        copies[expert].append(rank)
        rank_load[rank] += load
        rank_held[rank] += 1
    return Placement(copies, num_ranks, slots)


class Router:
    """Chooses a copy per token; `refresh` updates the load it balances on."""

    def __init__(self, placement: Placement, policy: str, ranks_per_node: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        self.placement, self.policy, self.ranks_per_node = placement, policy, ranks_per_node
        self.estimate = [0.0] * placement.num_ranks
        self._turn = [0] * len(placement.copies)

    def refresh(self, rank_loads: list[float]) -> None:
        self.estimate = list(rank_loads)

    def route(self, expert: int, tokens: int, source: int) -> dict[int, int]:
        """{rank: tokens} for `tokens` tokens of `expert` sent from rank `source`."""
        ranks = self.placement.copies[expert]
        if len(ranks) == 1:
            return {ranks[0]: tokens}
        if self.policy == "round_robin":
            out: dict[int, int] = {}
            for _ in range(tokens):
                rank = ranks[self._turn[expert] % len(ranks)]
                self._turn[expert] += 1
                out[rank] = out.get(rank, 0) + 1
            return out
        if self.policy == "locality":
            node = source // self.ranks_per_node
            for near in ([source], [r for r in ranks if r // self.ranks_per_node == node]):
                local = [r for r in ranks if r in near]
                if local:
                    return self._level(local, tokens)
        return self._level(ranks, tokens)

    def _level(self, ranks: list[int], tokens: int) -> dict[int, int]:
        """Split tokens over copies, each piece to the least-loaded one so far."""
        out: dict[int, int] = {}
        piece = max(1, -(-tokens // (4 * len(ranks))))
        while tokens:
            rank = min(ranks, key=lambda r: (self.estimate[r] + out.get(r, 0), r))
            sent = min(piece, tokens)
            out[rank] = out.get(rank, 0) + sent
            tokens -= sent
        return out

    def charge(self, rank: int, tokens: int) -> None:
        """Count tokens just sent to `rank` in the estimate (within a step)."""
        self.estimate[rank] += tokens
