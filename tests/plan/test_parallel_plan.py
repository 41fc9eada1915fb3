"""The parallel planner's arithmetic, checked by hand, and the reports' lessons it must
reproduce from first principles."""

from __future__ import annotations

import pytest

from tokenmill.cli import main
from tokenmill.model.arch import ArchConfig
from tokenmill.plan.clusters import Cluster
from tokenmill.plan.collective_cost import (
    Link,
    all_reduce_time,
    best_algorithm,
    ring_tree_crossover,
)
from tokenmill.plan.lessons import lesson_ring_vs_tree, lesson_tp_inside_pp_across
from tokenmill.plan.parallel import Layout, Workload, estimate

LINK = Link(25e9, 5e-6)


def test_collective_formulas_and_the_ring_tree_crossover():
    n = 1e6
    assert all_reduce_time("ring", n, 4, LINK) == pytest.approx(6 * 5e-6 + 1.5 * n / 25e9)
    assert all_reduce_time("tree", n, 4, LINK) == pytest.approx(4 * 5e-6 + 2 * n / 25e9)
    assert all_reduce_time("rhd", n, 4, LINK) == pytest.approx(4 * 5e-6 + 1.5 * n / 25e9)
    assert all_reduce_time("ring", n, 1, LINK) == 0.0
    # TECHNIQUES.md section 7: alpha 5 us, beta 25 GB/s -> 4 MB at 8, 22 MB at 16 ranks.
    assert ring_tree_crossover(8, LINK) == pytest.approx(4.0e6, rel=0.05)
    assert ring_tree_crossover(16, LINK) == pytest.approx(22e6, rel=0.05)
    below, above = ring_tree_crossover(16, LINK) * 0.5, ring_tree_crossover(16, LINK) * 2
    ring_small = all_reduce_time("ring", below, 16, LINK)
    assert all_reduce_time("tree", below, 16, LINK) < ring_small
    assert all_reduce_time("tree", above, 16, LINK) > all_reduce_time("ring", above, 16, LINK)
    assert best_algorithm(1e3, 8, LINK)[0] in ("tree", "rhd")


def tiny_arch() -> ArchConfig:
    return ArchConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1000,
        hidden_size=100, intermediate_size=200, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))


def test_a_two_rank_case_by_hand():
    arch = tiny_arch()
    link = Link(1e9, 1e-5)
    cluster = Cluster("toy", 2, link, Link(1e8, 1e-4), flops=1e12, memory=1e9,
                      memory_bandwidth=1e11)
    workload = Workload("prefill", batch=2, new_tokens=8, context=4, microbatches=2)
    params = arch.num_parameters
    # TP2: 16 tokens, 4 layers; attention 4 L T ctx H D; bf16 (2 bytes).
    tp = estimate(arch, cluster, Layout(2, 1), workload, efficiency=1.0, algorithm="ring")
    flops = (2 * params * 16 + 4 * 4 * 16 * 4 * 2 * 50) / 2
    reads = params * 2 / 2 + 2 * 4 * (2 * 2 * 50 * 2 * 4 / 2)
    compute = max(flops / 1e12, reads / 1e11)
    reduce = 2 * 1 * 1e-5 + (16 * 100 * 2) / 1e9  # ring, p = 2: 2 alpha + n / beta
    assert tp.compute_s == pytest.approx(compute)
    assert tp.tp_comm_s == pytest.approx(2 * 4 * reduce)
    assert tp.step_s == pytest.approx(compute + 2 * 4 * reduce)
    # PP2: two micro-batches of 8 tokens, 2 layers a stage, one send on the intra link.
    pp = estimate(arch, cluster, Layout(1, 2), workload, efficiency=1.0)
    flops_pp = 2 * params / 2 * 8 + 4 * 2 * 8 * 4 * 2 * 50
    reads_pp = params * 2 / 2 + 1 * 4 * (2 * 2 * 50 * 2 * 2)
    stage = max(flops_pp / 1e12, reads_pp / 1e11) + link.send_time(8 * 100 * 2)
    assert pp.step_s == pytest.approx((2 + 2 - 1) * stage)


def test_tp_inside_a_node_and_pp_across_beats_tp_across_nodes():
    """Lesson 2: 175B on 2 nodes, TP16 under 40% utilization, TP8 x PP2 over 75%."""
    util = lesson_tp_inside_pp_across("dgx-a100")
    assert util["TP16"] < 0.40 < 0.75 < util["TP8 x PP2"]


def test_tree_all_reduce_pays_above_24_gpus_for_small_messages():
    """Lesson 1: at 32 GPUs the all-reduce is over 60% of a TP step; the tree cuts it
    for latency-bound (decode) messages, not for bandwidth-bound (prefill) ones."""
    rows = {(r["gpus"], r["workload"]): r for r in lesson_ring_vs_tree()}
    assert rows[(32, "decode")]["ring_comm_share"] > 0.6
    assert rows[(32, "decode")]["tree_cut"] > 0.38
    assert abs(rows[(32, "prefill")]["tree_cut"]) < 0.1


def test_cli_ranks_layouts(capsys):
    assert main(["plan", "parallel", "--model", "gpt3-175b", "--gpus", "16"]) == 0
    out = capsys.readouterr().out
    assert out.index("TP8 x PP2") < out.index("| TP16 |")
    with pytest.raises(SystemExit) as exited:
        main(["plan", "parallel", "--model", "gpt3-175b", "--gpus", "16", "--intra-node", "fast"])
    assert exited.value.code == 2
    assert main(["plan", "parallel", "--model", "gpt3-175b", "--gpus", "0"]) == 2
