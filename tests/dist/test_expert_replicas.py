"""Replicated experts in the serving engine: the slots and moves a re-plan makes, the
copy each (token, expert) pair goes to, and, over two worker processes, the same greedy
tokens as one process whatever the routing policy, with weights moving every step."""

from __future__ import annotations

import pytest
import torch

import tokenmill.dist.expert_replicas as module
from tokenmill import LLM
from tokenmill.dist.eplb import Placement
from tokenmill.dist.expert_replicas import ExpertReplicas, plan_moves, slot_experts
from tests.dist.test_tensor_parallel import assert_same, generate


def test_a_replan_keeps_held_experts_in_their_slots():
    placement = Placement([[0, 1], [0], [0, 1], [1]], num_ranks=2, slots_per_rank=3)
    placement.check()
    assert slot_experts(placement) == [[0, 1, 2], [0, 2, 3]]
    # Rank 0 holds what it held; rank 1 keeps 3 and 0 where they were and takes 2 into
    # the slot expert 1 leaves.
    assert slot_experts(placement, [[2, 0, 1], [3, 1, 0]]) == [[2, 0, 1], [3, 2, 0]]


def test_moves_come_from_the_lowest_rank_that_held_the_expert():
    old = [[0, 1], [2, 3]]
    new = [[0, 3], [2, 3]]
    # Rank 0's slot 1 now holds expert 3, which rank 1 held in its slot 1.
    assert plan_moves(old, new) == [(0, 1, 1, 1)]
    new = [[0, 1], [2, 0]]
    assert plan_moves(old, new) == [(1, 1, 0, 0)]


def test_every_pair_goes_to_a_rank_holding_its_expert():
    replicas = ExpertReplicas(num_experts=4, size=2, rank=0, redundant=2, policy="round_robin")
    # Uniform load: the two spare copies go to experts 0 and 1, one on each rank.
    assert sorted(len(ranks) for ranks in replicas.placement.copies) == [1, 1, 2, 2]
    experts = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1]])
    dest = replicas.destinations(experts, torch.tensor([0, 0, 1, 1]))
    for expert, rank in zip(experts.flatten().tolist(), dest.flatten().tolist(), strict=True):
        assert rank in replicas.placement.copies[expert]
    # Round robin alternates expert 0's four pairs over its two copies.
    zero = dest[:, 0].tolist()
    assert sorted(zero) == sorted(replicas.placement.copies[0] * 2)


class FakeLayer:
    """What rebalance touches besides the weights: the slots."""

    def set_slots(self, slots):
        self.slots = slots


def rebalanced(replicas: ExpertReplicas) -> tuple[FakeLayer, list]:
    moves = []
    real, module._move_weights = module._move_weights, lambda *a: moves.append(a[1])
    try:
        layer = FakeLayer()
        replicas.rebalance(layer)
    finally:
        module._move_weights = real
    return layer, moves


def test_a_hot_expert_gets_the_spare_copies_after_a_rebalance():
    replicas = ExpertReplicas(num_experts=8, size=4, rank=0, redundant=4, policy="least_loaded")
    before = replicas.placement
    loads = [40, 2, 2, 2, 2, 2, 2, 2]
    replicas.record(loads)
    layer, moves = rebalanced(replicas)
    assert len(replicas.placement.copies[0]) > len(before.copies[0])
    assert max(replicas.placement.rank_loads(loads)) < 0.95 * max(before.rank_loads(loads))
    assert layer.slots == replicas.local_slots
    assert replicas.moves == len(moves[0]) > 0
    # The estimate holds the planned load per rank: least-loaded sends one pair to the
    # lightest rank holding a copy (the lower on a tie), and pairs beyond the gaps to
    # every copy's rank.
    estimate = list(replicas.router.estimate)
    holders = set(replicas.placement.copies[0])
    lightest = min(holders, key=lambda r: (estimate[r], r))
    assert replicas.destinations(torch.tensor([[0]]), None).item() == lightest
    dest = replicas.destinations(torch.tensor([[0]] * 400), None).flatten()
    assert set(dest.tolist()) == holders
    assert replicas.router.estimate == estimate  # a step's charges do not stay


def test_a_replan_that_gains_little_moves_nothing():
    # Two ranks: a third copy of the hot expert would sit beside another on one rank,
    # no better than two copies; the plan stays, only the estimate is refreshed.
    replicas = ExpertReplicas(num_experts=4, size=2, rank=0, redundant=2, policy="least_loaded")
    before = replicas.placement
    replicas.record([40, 2, 2, 2])
    _, moves = rebalanced(replicas)
    assert moves == [] and replicas.placement is before
    assert replicas.router.estimate == before.rank_loads([40, 2, 2, 2])


# Choosing among identical copies never changes output: every policy, with the copies
# re-planned (weights moved between the ranks) before every step.
@pytest.mark.parametrize(("policy", "sequence_parallel"), [
    ("round_robin", True), ("least_loaded", True), ("locality", True),
    ("least_loaded", False)])
def test_replicated_experts_give_one_ranks_tokens(model_factory, policy, sequence_parallel):
    model_dir = model_factory("mixtral")
    reference, single = generate(model_dir)
    outputs, engine = generate(model_dir, tensor_parallel_size=2, expert_parallel=True,
                               sequence_parallel=sequence_parallel, expert_redundant_slots=2,
                               expert_routing=policy, expert_balance_window_s=0)
    assert_same(reference, outputs)
    assert engine.expert_load.totals == single.expert_load.totals
    assert engine.expert_moves > 0  # copies did move while serving
    # Every (token, expert) pair computed once, on some rank.
    pairs = [sum(layer) for layer in single.expert_load.totals]
    assert [sum(layer) for layer in engine.rank_load.totals] == pairs


def test_replication_knobs_reject_what_cannot_work(model_factory):
    model_dir = model_factory("mixtral")
    with pytest.raises(ValueError, match="expert_redundant_slots"):
        LLM(str(model_dir), progress=False, tensor_parallel_size=2, expert_redundant_slots=2)
    with pytest.raises(ValueError, match="expert_redundant_slots"):
        LLM(str(model_dir), progress=False, tensor_parallel_size=2, expert_parallel=True,
            expert_redundant_slots=2, quantization="int8")
    with pytest.raises(ValueError, match="fill"):  # 4 + 1 copies do not split over 2
        LLM(str(model_dir), progress=False, tensor_parallel_size=2, expert_parallel=True,
            expert_redundant_slots=1)


@pytest.mark.parametrize("options", [
    {}, {"expert_parallel": True}, {"expert_parallel": True, "expert_redundant_slots": 2}])
def test_memory_plan_counts_a_ranks_experts_and_replicas(model_factory, options):
    """`tokenmill plan memory` under TP counts one rank's weights as start-up measures
    them: a shard of every expert, E / TP whole ones, or (E + R) / TP with replicas."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.worker.memory import plan_deployment_memory

    kwargs = {"model": str(model_factory("mixtral")), "tensor_parallel_size": 2,
              "num_blocks": 16, **options}
    engine = LLMEngine.from_kwargs(progress=False, **kwargs)
    try:
        measured = engine.executor.rank_memory[0].weights
    finally:
        engine.shutdown()
    plan = plan_deployment_memory(EngineConfig.from_kwargs(**kwargs), context=64,
                                  concurrency=2, device_memory=10**9)
    assert plan.weights_bytes == measured


def test_the_engine_orders_a_rebalance_once_per_window(monkeypatch):
    """A fake clock: the first step after each window re-plans, the others do not;
    window 0 re-plans every step, inf never, and no replicas never."""
    from types import SimpleNamespace

    import tokenmill.engine.engine as engine_module
    from tokenmill.config import EngineConfig
    from tokenmill.engine.engine import LLMEngine

    clock = [100.0]
    monkeypatch.setattr(engine_module.time, "monotonic", lambda: clock[0])

    def steps(window, times, redundant=2):
        config = EngineConfig.from_kwargs(
            tensor_parallel_size=2, expert_parallel=redundant > 0,
            expert_redundant_slots=redundant, expert_balance_window_s=window)
        fake = SimpleNamespace(config=config, _balanced_at=100.0)
        due = []
        for now in times:
            clock[0] = now
            due.append(LLMEngine._rebalance_due(fake))
        return due

    assert steps(0.1, [100.05, 100.11, 100.15, 100.22, 100.25]) == [
        False, True, False, True, False]
    assert steps(0.0, [100.0, 100.0, 100.01]) == [True, True, True]
    assert steps(float("inf"), [1e9]) == [False]
    assert steps(0.1, [200.0], redundant=0) == [False]


def test_the_replan_gain_threshold_is_a_knob():
    # The 4-rank plan of test_a_hot_expert_gets_the_spare_copies_after_a_rebalance cuts
    # the busiest rank's load by less than 90%: with that threshold nothing moves.
    replicas = ExpertReplicas(num_experts=8, size=4, rank=0, redundant=4,
                              policy="least_loaded", min_gain=0.9)
    before = replicas.placement
    replicas.record([40, 2, 2, 2, 2, 2, 2, 2])
    _, moves = rebalanced(replicas)
    assert moves == [] and replicas.placement is before
    with pytest.raises(ValueError, match="expert_replan_min_gain"):
        LLM("unused", progress=False, expert_replan_min_gain=1.0)
