"""The replication planner and the MoE cluster simulator, checked by hand."""

from __future__ import annotations

import pytest

from tokenmill.plan.collective_cost import Link
from tokenmill.dist.eplb import Placement, Router, plan_replicas, plan_without_replicas
from tokenmill.plan.moe_sim import MoeCluster, MoeWorkload, balanced_step, simulate, step_time


def test_replicas_go_to_the_hot_expert_and_balance_the_ranks():
    loads = [17.0, 1, 1, 1, 1, 1, 1, 1]
    plain = plan_without_replicas(8, 4)
    plain.check()
    replicas = plan_replicas(loads, 4, redundant=4)
    replicas.check()
    assert len(replicas.copies[0]) == 5  # every spare slot: 17/5 is still the hottest
    assert len(set(replicas.copies[0])) == 4  # on distinct ranks, then doubled up
    assert max(replicas.rank_loads(loads)) < max(plain.rank_loads(loads)) / 2
    with pytest.raises(ValueError, match="fill"):
        plan_replicas(loads, 4, redundant=3)


def test_hand_computed_replication():
    placement = plan_replicas([6.0, 2.0], 2, redundant=2)
    # Copies: expert 0 gets both spares (6/2 = 3 > 2, then 6/3 = 2 ties 2 and the
    # lower id wins); the four copies of load 2 fill two slots per rank.
    assert sorted(len(c) for c in placement.copies) == [1, 3]
    assert placement.rank_loads([6.0, 2.0]) == [4.0, 4.0]


def test_routing_policies_split_by_load_and_locality():
    placement = Placement([[0, 1], [0], [1]], num_ranks=2, slots_per_rank=2)
    placement.check()
    round_robin = Router(placement, "round_robin", ranks_per_node=1)
    assert round_robin.route(0, 5, source=0) == {0: 3, 1: 2}
    least = Router(placement, "least_loaded", ranks_per_node=1)
    least.refresh([8.0, 0.0])
    assert least.route(0, 8, source=0) == {1: 8}  # rank 0 is already 8 ahead
    local = Router(placement, "locality", ranks_per_node=1)
    assert local.route(0, 8, source=1) == {1: 8}  # its own rank holds a copy
    with pytest.raises(ValueError, match="routing policy"):
        Router(placement, "random", 1)


def test_two_rank_step_by_hand():
    # Two nodes of one rank; 1 ms + 1 MB/s links; 1 ms per expert token.
    link = Link(1e6, 1e-3)
    cluster = MoeCluster(2, 1, link, link)
    work = MoeWorkload(experts=2, top_k=1, tokens=4, bytes_per_token=1000,
                       expert_token_s=1e-3, skew=1.0, steps=3)
    # Each rank computes 4 pairs (4 ms) and sends 2 rows (1 ms + 2 ms) each way, twice.
    assert step_time(cluster, work, [[2, 2], [2, 2]]) == pytest.approx(0.010)
    assert balanced_step(cluster, work) == pytest.approx(0.010)
    row = simulate(cluster, work, None, "least_loaded", 0.0, 0.0)
    assert row["step_ms"] == pytest.approx(10.0)
    assert row["relative_throughput"] == pytest.approx(1.0)
    # A refresh every step costs its price each step but the first.
    paid = simulate(cluster, work, 0, "least_loaded", 0.0, 0.003)
    assert paid["step_ms"] == pytest.approx(10.0 + 3.0 * 2 / 3)


def test_simulate_moe_command_reports_scenarios(capsys, tmp_path):
    from tokenmill.cli import main

    assert main(["simulate", "moe", "--ranks", "4", "--ranks-per-node", "2", "--experts", "8",
                 "--redundant", "4", "--tokens", "64", "--steps", "20", "--windows-ms", "0,100",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no replication" in out and "least_loaded, window 100 ms" in out
    assert (tmp_path / "moe_sim.png").stat().st_size > 0


def test_simulate_moe_rejects_impossible_clusters(capsys):
    from tokenmill.cli import main

    assert main(["simulate", "moe", "--ranks", "0"]) == 2
    assert main(["simulate", "moe", "--top-k", "65"]) == 2
    assert "--top-k" in capsys.readouterr().err


def test_simulate_moe_calibrates_what_it_can(capsys, tmp_path, monkeypatch):
    from tokenmill.cli import main

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    assert main(["simulate", "moe", "--cluster", "local", "--ranks", "2"]) == 2
    assert "tokenmill bench collectives" in capsys.readouterr().err
    (tmp_path / "collectives-fit.json").write_text(
        '{"backend": {"alpha_s": 1e-4, "beta_bytes_per_s": 1e9, "ranks": 2}}')
    assert main(["simulate", "moe", "--cluster", "local", "--ranks", "2", "--ranks-per-node",
                 "2", "--experts", "8", "--redundant", "2", "--tokens", "64", "--steps", "5",
                 "--windows-ms", "100", "--measure-expert", "64,128"]) == 0
    out = capsys.readouterr().out
    assert "measured:" in out and "local links" in out
    assert main(["simulate", "moe", "--measure-expert", "64"]) == 2
