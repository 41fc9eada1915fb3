"""Which TP x PP layout to run a model in on a cluster: a first-principles cost model.

Ranks are laid out tensor-parallel innermost (a TP group's ranks are consecutive, so a
group of at most gpus_per_node ranks sits in one node), pipeline stages outermost.
For one step of a workload (a prefill of `batch` prompts, or one decode token for each
of `batch` sequences), each stage handles L / pp layers of each of m micro-batches:

    compute   max(2 (P / pp) T_m / tp + attention FLOPs) / (flops x efficiency),
                  (weights + KV read by the stage) / memory bandwidth)
    TP        2 all-reduces per layer of T_m h bytes among tp ranks, on the node's
              link when the group fits in a node, else on the inter-node link; the
              algorithm is the cheapest for the message (plan/collective_cost.py)
    PP        one send of T_m h bytes to the next stage (inter-node when the
              boundary crosses a node)
    step      (m + pp - 1) x (compute + TP + send): the pipeline fills and drains

Utilization is the step's useful compute (the whole model's FLOPs on all devices at
the efficiency given) over its time. Every term is printed, so a ranking can be
checked by hand (tests/plan/test_parallel_plan.py does, on a 2-rank case).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.model.arch import ArchConfig
from tokenmill.plan.clusters import Cluster
from tokenmill.plan.collective_cost import Link, all_reduce_time, best_algorithm


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int  # sequences
    new_tokens: int  # per sequence this step (prompt length, or 1 when decoding)
    context: int  # tokens each sequence attends to (its KV), on average
    microbatches: int = 8  # in flight through a pipeline


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"TP{self.tp}" + (f" x PP{self.pp}" if self.pp > 1 else "")


@dataclass
class Estimate:
    layout: Layout
    workload: Workload
    compute_s: float  # per stage per micro-batch
    tp_comm_s: float
    pp_send_s: float
    step_s: float
    utilization: float
    memory_per_gpu: float
    fits: bool
    algorithm: str
    tp_link: str
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.workload.batch * self.workload.new_tokens / self.step_s

    @property
    def comm_share(self) -> float:
        per_microbatch = self.compute_s + self.tp_comm_s + self.pp_send_s
        return (self.tp_comm_s + self.pp_send_s) / per_microbatch


def _tp_link(layout: Layout, cluster: Cluster) -> tuple[Link, str]:
    if layout.tp <= cluster.gpus_per_node:
        return cluster.intra_node, "intra-node"
    return cluster.inter_node, "inter-node"


def _pp_link(layout: Layout, cluster: Cluster) -> Link:
    """The slowest stage boundary's link."""
    for stage in range(layout.pp - 1):
        last, first = (stage + 1) * layout.tp - 1, (stage + 1) * layout.tp
        if last // cluster.gpus_per_node != first // cluster.gpus_per_node:
            return cluster.inter_node
    return cluster.intra_node


def estimate(arch: ArchConfig, cluster: Cluster, layout: Layout, workload: Workload,
             efficiency: float = 0.5, bytes_per_param: int = 2,
             algorithm: str | None = None) -> Estimate:
    """The step of `workload` in `layout` (algorithm None: the cheapest per message)."""
    tp, pp, e = layout.tp, layout.pp, bytes_per_param
    m = min(workload.microbatches, workload.batch) if pp > 1 else 1
    tokens = workload.batch * workload.new_tokens
    tokens_mb = tokens / m
    layers = arch.num_layers / pp
    params = arch.num_parameters
    attention = 4 * layers * tokens_mb * workload.context * arch.num_heads * arch.head_dim
    flops = (2 * params / pp * tokens_mb + attention) / tp
    kv_per_token = 2 * arch.num_kv_heads * arch.head_dim * e * layers / min(tp, arch.num_kv_heads)
    reads = params * e / (tp * pp) + workload.batch / m * workload.context * kv_per_token
    compute = max(flops / (cluster.flops * efficiency), reads / cluster.memory_bandwidth)
    link, link_name = _tp_link(layout, cluster)
    message = tokens_mb * arch.hidden_size * e
    if algorithm is None:
        algorithm, per_reduce = best_algorithm(message, tp, link)
    else:
        per_reduce = all_reduce_time(algorithm, message, tp, link)
    tp_comm = 2 * layers * per_reduce
    send = _pp_link(layout, cluster).send_time(message) if pp > 1 else 0.0
    step = (m + pp - 1) * (compute + tp_comm + send)
    useful = (2 * params * tokens + attention * m * pp) / (layout.gpus * cluster.flops * efficiency)
    kv_bytes = workload.batch * (workload.context + workload.new_tokens) * kv_per_token
    memory = params * e / (tp * pp) + kv_bytes
    return Estimate(layout, workload, compute, tp_comm, send, step, useful / step, memory,
                    memory <= cluster.memory, algorithm if tp > 1 else "-", link_name)


def layouts(arch: ArchConfig, gpus: int) -> list[Layout]:
    """TP x PP = gpus with TP a power of two that splits the heads, PP at most the layers."""
    found = []
    tp = 1
    while tp <= gpus:
        if gpus % tp == 0 and arch.num_heads % tp == 0 and gpus // tp <= arch.num_layers:
            found.append(Layout(tp, gpus // tp))
        tp *= 2
    return found


def rank_layouts(arch: ArchConfig, cluster: Cluster, gpus: int, workload: Workload,
                 efficiency: float = 0.5) -> list[Estimate]:
    """Every layout's estimate, those that fit first, fastest first."""
    estimates = [estimate(arch, cluster, layout, workload, efficiency)
                 for layout in layouts(arch, gpus)]
    return sorted(estimates, key=lambda est: (not est.fits, est.step_s))


def explain(est: Estimate, cluster: Cluster) -> str:
    """One line on what dominates this layout's step."""
    if not est.fits:
        return (f"does not fit: {est.memory_per_gpu / 1e9:.0f} GB per GPU of "
                f"{cluster.memory / 1e9:.0f}")
    parts = [f"compute {est.compute_s * 1e3:.2f} ms"]
    if est.layout.tp > 1:
        parts.append(f"TP all-reduce {est.tp_comm_s * 1e3:.2f} ms ({est.algorithm}, "
                     f"{est.tp_link})")
    if est.layout.pp > 1:
        m = est.workload.microbatches
        parts.append(f"PP send {est.pp_send_s * 1e3:.3f} ms, bubble "
                     f"{(est.layout.pp - 1) / (min(m, est.workload.batch) + est.layout.pp - 1):.0%}")
    share = f"communication {est.comm_share:.0%} of a stage's time"
    return "per stage and micro-batch: " + ", ".join(parts) + f"; {share}"

