"""The reports' three layout lessons, put to the cost model (`tokenmill plan parallel
--lessons`): what it reproduces, and why.

1. 32 A100s (4 nodes x 8, RoCEv2) in tensor parallelism: all-reduce took over 60% of a
   step, and tree all-reduce cut communication by 38% above 24 GPUs.
2. A 175B model on 2 nodes: TP16 below 40% utilization, TP8 inside each node x PP2
   across them above 75%.
3. The best layout differs between A100 and H100 clusters.
"""

from __future__ import annotations

from tokenmill.model.arch import ArchConfig
from tokenmill.plan.clusters import CLUSTERS, MODEL_SHAPES
from tokenmill.plan.parallel import Layout, Workload, estimate, rank_layouts

DECODE = Workload("decode", 64, 1, 2048, 8)
PREFILL = Workload("prefill", 8, 2048, 1024, 8)


def lesson_ring_vs_tree(ranks: tuple[int, ...] = (8, 16, 24, 32)) -> list[dict]:
    """TP across `ranks` A100s over RoCE (Llama 2 70B): the all-reduce's share of a step
    and what the tree saves on it, for decode-sized and prefill-sized messages."""
    arch = ArchConfig.from_hf_config(MODEL_SHAPES["llama2-70b"])
    cluster = CLUSTERS["a100-roce"]
    rows = []
    for gpus in ranks:
        for workload in (DECODE, Workload("prefill", 4, 2048, 1024, 1)):
            ring = estimate(arch, cluster, Layout(gpus, 1), workload, algorithm="ring")
            tree = estimate(arch, cluster, Layout(gpus, 1), workload, algorithm="tree")
            rows.append({"gpus": gpus, "workload": workload.name,
                         "ring_comm_share": ring.comm_share,
                         "tree_comm_share": tree.comm_share,
                         "tree_cut": 1 - tree.tp_comm_s / ring.tp_comm_s})
    return rows


def lesson_tp_inside_pp_across(cluster_name: str = "dgx-a100") -> dict[str, float]:
    """GPT-3 175B on 16 GPUs (2 nodes): prefill utilization of TP16 and TP8 x PP2."""
    arch = ArchConfig.from_hf_config(MODEL_SHAPES["gpt3-175b"])
    cluster = CLUSTERS[cluster_name]
    return {str(layout): estimate(arch, cluster, layout, PREFILL).utilization
            for layout in (Layout(16, 1), Layout(8, 2))}


def lesson_a100_vs_h100() -> list[str]:
    """Workloads whose best layout differs between the two clusters (Llama 2 70B)."""
    arch = ArchConfig.from_hf_config(MODEL_SHAPES["llama2-70b"])
    found = []
    for gpus, workload in ((8, Workload("prefill", 16, 2048, 1024, 8)),
                           (16, Workload("decode", 256, 1, 4096, 8))):
        best = {name: rank_layouts(arch, CLUSTERS[name], gpus, workload)[0]
                for name in ("dgx-a100", "dgx-h100")}
        a100, h100 = best["dgx-a100"], best["dgx-h100"]
        if str(a100.layout) != str(h100.layout):
            found.append(f"Llama 2 70B, {gpus} GPUs, {workload.name} batch {workload.batch}: "
                         f"A100 {a100.layout} (communication {a100.comm_share:.0%}), H100 "
                         f"{h100.layout} (communication {h100.comm_share:.0%})")
    return found


def report() -> str:
    lines = ["Lesson 1: TP over 4 nodes of 8 A100 (RoCEv2), Llama 2 70B",
             "| GPUs | step | ring: all-reduce share | tree: share | tree cuts all-reduce |",
             "| --- | --- | --- | --- | --- |"]
    for row in lesson_ring_vs_tree():
        lines.append(f"| {row['gpus']} | {row['workload']} | {row['ring_comm_share']:.0%} | "
                     f"{row['tree_comm_share']:.0%} | {row['tree_cut']:.0%} |")
    lines += ["", "Lesson 2: GPT-3 175B on 16 GPUs (2 nodes), prefill 8 x 2048, utilization"]
    for cluster in ("dgx-a100", "dgx-h100"):
        util = lesson_tp_inside_pp_across(cluster)
        lines.append(f"- {cluster}: " + ", ".join(f"{k} {v:.0%}" for k, v in util.items()))
    lines += ["", "Lesson 3: where the best layout differs between A100 and H100"]
    lines += [f"- {line}" for line in lesson_a100_vs_h100()] or ["- nowhere in the cases tried"]
    return "\n".join(lines)
