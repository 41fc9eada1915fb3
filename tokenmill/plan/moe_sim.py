"""`tokenmill simulate moe`: expert parallelism at cluster scale, step by step.

Each step every rank holds `tokens` tokens, each routed to top-k experts by an expert
popularity with one hot expert (`skew` times the others' load) that moves to another
expert every `drift_s` seconds. Tokens are sent to a copy of their expert (all-to-all
dispatch), computed there, and sent back (combine). A step takes

    max over ranks of (tokens computed x expert_token_s)           the trailing rank
    + 2 x max over ranks of sum over peers (latency + bytes / bandwidth)   dispatch, combine
    + replan_s when the router's load estimate is refreshed in this step

with NVLink-class links inside a node and RoCE-class links between nodes (the
a100-roce preset's published figures), or this machine's gloo link as `tokenmill bench
collectives` fitted it (`--cluster local`). Throughput is reported relative to the same
step with perfectly balanced experts and uniform traffic. Assumptions unless measured:
the expert compute per token (`--measure-expert` times one expert's shape here; the
engine's replicas measure the re-planning cost: benchmarks/bench_moe_replicas.py), the
refresh cost and the drift.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from tokenmill.dist.eplb import Router, plan_replicas, plan_without_replicas
from tokenmill.plan.clusters import CLUSTERS, calibrated_local
from tokenmill.plan.collective_cost import Link


@dataclass(frozen=True)
class MoeCluster:
    ranks: int
    ranks_per_node: int
    intra: Link
    inter: Link

    def link(self, a: int, b: int) -> Link:
        same = a // self.ranks_per_node == b // self.ranks_per_node
        return self.intra if same else self.inter


@dataclass(frozen=True)
class MoeWorkload:
    experts: int = 64
    top_k: int = 2
    tokens: int = 4096  # per rank per step
    bytes_per_token: int = 8192  # hidden 4096 in bf16
    expert_token_s: float = 0.9e-6  # 3 x 2 x 4096 x 14336 FLOP at ~400 TFLOP/s
    skew: float = 17.0  # the hot expert's load over another's
    drift_s: float = 2.0
    step_s: float = 0.05  # trace time between steps
    steps: int = 200


def popularity(workload: MoeWorkload, time_s: float) -> list[float]:
    hot = int(time_s // workload.drift_s) % workload.experts
    weights = [workload.skew if e == hot else 1.0 for e in range(workload.experts)]
    total = sum(weights)
    return [w / total for w in weights]


def assignments(workload: MoeWorkload, time_s: float) -> list[int]:
    """(token, expert) pairs each rank sends to each expert in a step."""
    share = popularity(workload, time_s)
    return [round(workload.tokens * workload.top_k * p) for p in share]


def step_time(cluster: MoeCluster, workload: MoeWorkload, traffic: list[list[int]]) -> float:
    """traffic[src][dst]: pairs rank src sends to rank dst."""
    computed = [sum(traffic[src][dst] for src in range(cluster.ranks))
                for dst in range(cluster.ranks)]
    compute = max(computed) * workload.expert_token_s
    send = 0.0
    for src in range(cluster.ranks):
        seconds = sum(cluster.link(src, dst).send_time(count * workload.bytes_per_token)
                      for dst, count in enumerate(traffic[src]) if dst != src and count)
        send = max(send, seconds)
    return compute + 2 * send


def balanced_step(cluster: MoeCluster, workload: MoeWorkload) -> float:
    pairs = workload.tokens * workload.top_k
    share = [[pairs // cluster.ranks] * cluster.ranks for _ in range(cluster.ranks)]
    return step_time(cluster, workload, share)


def simulate(cluster: MoeCluster, workload: MoeWorkload, redundant: int | None, policy: str,
             window_s: float, replan_s: float) -> dict:
    """redundant None: no replication (contiguous blocks). Otherwise every `window_s`
    the placement is re-planned (plan_replicas) from the experts' mean load over the
    last window, and the router balances on it; each refresh costs replan_s."""
    uniform = [1.0] * workload.experts
    history: list[tuple[float, list[int]]] = []
    router = last_refresh = None
    total = fan_out = moved = 0.0
    for index in range(workload.steps):
        now = index * workload.step_s
        cost = 0.0
        if router is None or (redundant is not None and now - last_refresh >= window_s):
            # The steps of the last window (at least the last step), by index: times
            # in float would drop a boundary step.
            span = max(1, round(min(window_s, 1e9) / workload.step_s))
            recent = [loads for _, loads in history[-span:]]
            expert_loads = ([sum(c) / len(recent) for c in zip(*recent, strict=True)]
                            if recent else uniform)
            placement = (plan_without_replicas(workload.experts, cluster.ranks)
                         if redundant is None
                         else plan_replicas(expert_loads, cluster.ranks, redundant))
            router = Router(placement, policy, cluster.ranks_per_node)
            router.refresh(placement.rank_loads(expert_loads))
            cost = replan_s if recent and redundant is not None else 0.0
            last_refresh = now
        base = list(router.estimate)
        traffic = [[0] * cluster.ranks for _ in range(cluster.ranks)]
        counts = assignments(workload, now)
        for src in range(cluster.ranks):
            for expert, count in enumerate(counts):
                if not count:
                    continue
                for dst, sent in router.route(expert, count, src).items():
                    traffic[src][dst] += sent
                    router.charge(dst, sent)
        router.estimate = base
        history.append((now, [c * cluster.ranks for c in counts]))
        total += step_time(cluster, workload, traffic) + cost
        fan_out += sum(sum(1 for d, c in enumerate(row) if c and d != s)
                       for s, row in enumerate(traffic))
        moved += sum(c for s, row in enumerate(traffic) for d, c in enumerate(row) if d != s)
    mean_step = total / workload.steps
    return {"policy": policy, "window_s": window_s, "step_ms": mean_step * 1e3,
            "relative_throughput": balanced_step(cluster, workload) / mean_step,
            "fan_out_per_rank": fan_out / workload.steps / cluster.ranks,
            "all_to_all_mb_per_step": moved * workload.bytes_per_token / workload.steps / 1e6}


def scenarios(cluster: MoeCluster, workload: MoeWorkload, redundant: int, windows: list[float],
              replan_s: float) -> list[dict]:
    """No replication; replicas with round-robin routing planned once on start-up
    (uniform load: the naive way); re-planned replicas with load-aware and
    locality-aware routing at each window."""
    rows = [dict(simulate(cluster, workload, None, "least_loaded", 0.0, 0.0),
                 scenario="no replication")]
    rows.append(dict(simulate(cluster, workload, redundant, "round_robin", float("inf"), 0.0),
                     scenario=f"{redundant} replicas planned once, round-robin"))
    for policy in ("least_loaded", "locality"):
        for window in windows:
            rows.append(dict(simulate(cluster, workload, redundant, policy, window, replan_s),
                             scenario=f"{redundant} replicas, {policy}, window {window * 1e3:g} ms"))
    return rows


def add_simulate_subcommand(sub: argparse._SubParsersAction) -> None:
    simulate_parser = sub.add_parser("simulate", help="cluster-scale simulations")
    targets = simulate_parser.add_subparsers(dest="simulate_target", required=True)
    moe = targets.add_parser("moe", help="expert parallelism with hot experts: replication "
                                         "and routing policies on a simulated cluster")
    moe.add_argument("--ranks", type=int, default=32)
    moe.add_argument("--ranks-per-node", type=int, default=8)
    moe.add_argument("--cluster", choices=[*sorted(CLUSTERS), "local"], default="a100-roce",
                     help="the links (intra- and inter-node) of this preset; local: this "
                          "machine's gloo link as `tokenmill bench collectives` fitted it")
    moe.add_argument("--experts", type=int, default=64)
    moe.add_argument("--top-k", type=int, default=2)
    moe.add_argument("--tokens", type=int, default=4096, help="per rank per step")
    moe.add_argument("--skew", type=float, default=17.0)
    moe.add_argument("--redundant", type=int, default=32, help="extra expert slots in all")
    moe.add_argument("--windows-ms", default="0,10,100,1000,5000")
    moe.add_argument("--replan-ms", type=float, default=2.0,
                     help="cost of refreshing the router's load estimate (an assumption)")
    moe.add_argument("--steps", type=int, default=200)
    moe.add_argument("--expert-token-us", type=float, default=None,
                     help="expert compute per (token, expert) pair (default 0.9 us: an "
                          "assumption, Mixtral-size experts at ~400 TFLOP/s)")
    moe.add_argument("--measure-expert", default=None, metavar="HIDDEN,INTERMEDIATE",
                     help="measure the per-pair compute of one gated-MLP expert of this "
                          "shape on this machine's threads and use it")
    moe.add_argument("--out", type=Path, default=None, help="folder for moe_sim.json / .png")
    moe.add_argument("--log-level", default="warning")
    moe.set_defaults(func=cmd_simulate_moe)


def _links(cluster: str) -> tuple[Link, Link]:
    """(intra-node, inter-node) links of a preset, or this machine's fitted gloo link."""
    if cluster != "local":
        return CLUSTERS[cluster].intra_node, CLUSTERS[cluster].inter_node
    local = calibrated_local(0.0, 0.0, 0.0)
    if local is None:
        raise ValueError("--cluster local needs `tokenmill bench collectives` run on this "
                         "machine first (it fits the link)")
    return local.intra_node, local.inter_node


def measure_expert_token_s(hidden: int, intermediate: int, rows: int) -> float:
    """Seconds per row of one float32 gated-MLP expert (gate/up, SiLU, down) on `rows`
    rows, best of 5 after a warm-up, on torch's current threads."""
    import time

    import torch
    import torch.nn.functional as F

    gate_up = torch.randn(2 * intermediate, hidden) / hidden**0.5
    down = torch.randn(hidden, intermediate) / intermediate**0.5
    x = torch.randn(rows, hidden)
    best = float("inf")
    for _ in range(6):
        started = time.perf_counter()
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        F.linear(F.silu(gate) * up, down)
        best = min(best, time.perf_counter() - started)
    return best / rows


def cmd_simulate_moe(args: argparse.Namespace) -> int:
    try:
        for name in ("ranks", "ranks_per_node", "experts", "tokens", "steps", "redundant"):
            if getattr(args, name) < (0 if name == "redundant" else 1):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer")
        if not 1 <= args.top_k <= args.experts:
            raise ValueError("--top-k must be between 1 and --experts")
        cluster = MoeCluster(args.ranks, args.ranks_per_node, *_links(args.cluster))
        expert_s = MoeWorkload.expert_token_s
        if args.measure_expert:
            hidden, intermediate = (int(v) for v in args.measure_expert.split(","))
            rows = max(1, args.tokens * args.top_k // args.experts)
            expert_s = measure_expert_token_s(hidden, intermediate, rows)
            print(f"measured: {expert_s * 1e6:.3f} us per (token, expert) pair for a "
                  f"{hidden} x {intermediate} expert at {rows} rows")
        elif args.expert_token_us is not None:
            expert_s = args.expert_token_us / 1e6
        workload = MoeWorkload(args.experts, args.top_k, args.tokens, skew=args.skew,
                               steps=args.steps, expert_token_s=expert_s)
        windows = [float(w) / 1e3 for w in args.windows_ms.split(",")]
        rows = scenarios(cluster, workload, args.redundant, windows, args.replan_ms / 1e3)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.ranks} ranks ({args.ranks_per_node} per node, {args.cluster} links), "
          f"{args.experts} experts top-{args.top_k}, one at {args.skew:g}x, moving every "
          f"{workload.drift_s:g} s; {args.tokens} tokens per rank per step")
    print("| scenario | step ms | throughput vs balanced | peers per rank | all-to-all MB/step |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['scenario']} | {row['step_ms']:.2f} | {row['relative_throughput']:.0%} | "
              f"{row['fan_out_per_rank']:.1f} | {row['all_to_all_mb_per_step']:.0f} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_sim.json").write_text(json.dumps(rows, indent=1))
        plot(rows, args.out / "moe_sim.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for policy in ("least_loaded", "locality"):
        points = [(r["window_s"] * 1e3, r["relative_throughput"]) for r in rows
                  if r["policy"] == policy and "window" in r["scenario"]]
        axes.plot([max(p[0], 1) for p in points], [p[1] for p in points], marker="o",
                  label=f"replicas, {policy}")
    for row in rows[:2]:
        axes.axhline(row["relative_throughput"], linestyle="--", label=row["scenario"],
                     color="gray" if row is rows[0] else "tab:red")
    axes.set_xscale("log")
    axes.set_xlabel("load-estimate window, ms (0 plotted at 1)")
    axes.set_ylabel("throughput / balanced")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
