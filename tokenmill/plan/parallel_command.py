"""`tokenmill plan parallel`: rank TP x PP layouts of a model on a cluster.

    tokenmill plan parallel --model gpt3-175b --gpus 16 --cluster dgx-a100
    tokenmill plan parallel --model DIR --gpus 8 --gpus-per-node 4 \\
        --intra-node 300,3 --inter-node 25,8 --device-flops 312e12 --device-memory 80e9

Links are "GB/s,microseconds" (bandwidth per direction, latency per message).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tokenmill.model.arch import ArchConfig
from tokenmill.plan.clusters import (
    CLUSTERS,
    MODEL_SHAPES,
    Cluster,
    calibrated_local,
    measure_local_device,
)
from tokenmill.plan.collective_cost import Link
from tokenmill.plan.parallel import Workload, explain, rank_layouts


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help=f"a model directory or a shape: {', '.join(MODEL_SHAPES)}")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--cluster", choices=sorted(CLUSTERS) + ["local"], default="dgx-a100",
                        help="preset the flags below override; local: this machine's "
                             "processes (1 thread each), GEMM rate and bandwidth measured "
                             "now, links fitted by `tokenmill bench collectives`")
    parser.add_argument("--gpus-per-node", type=int, default=None)
    parser.add_argument("--intra-node", type=_link, default=None, metavar="GB/S,US")
    parser.add_argument("--inter-node", type=_link, default=None, metavar="GB/S,US")
    parser.add_argument("--device-flops", type=float, default=None)
    parser.add_argument("--device-memory", type=float, default=None)
    parser.add_argument("--efficiency", type=float, default=0.5,
                        help="fraction of peak FLOP/s a device reaches (default 0.5)")
    parser.add_argument("--workload", choices=["prefill", "decode"], default="prefill")
    parser.add_argument("--batch", type=int, default=8, help="sequences in a step")
    parser.add_argument("--prompt", type=int, default=2048, help="prefill tokens per sequence")
    parser.add_argument("--context", type=int, default=2048, help="decode: tokens in the KV")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--log-level", default="warning")
    parser.set_defaults(func=cmd_plan_parallel)


def _link(text: str) -> Link:
    try:
        bandwidth, latency = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GB/S,MICROSECONDS, got {text!r}") from None
    return Link(bandwidth * 1e9, latency * 1e-6)


def model_arch(name: str) -> ArchConfig:
    if name in MODEL_SHAPES:
        return ArchConfig.from_hf_config(MODEL_SHAPES[name])
    from tokenmill.model.loader import read_config

    return read_config(name)


def local_cluster() -> Cluster:
    cluster = calibrated_local(*measure_local_device())
    if cluster is None:
        raise ValueError("--cluster local needs the link fits `tokenmill bench collectives` "
                         "writes; run it on this machine first")
    return cluster


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    cluster = local_cluster() if args.cluster == "local" else CLUSTERS[args.cluster]
    overrides = {field: value for field, value in (
        ("gpus_per_node", args.gpus_per_node), ("intra_node", args.intra_node),
        ("inter_node", args.inter_node), ("flops", args.device_flops),
        ("memory", args.device_memory)) if value is not None}
    if overrides:
        cluster = dataclasses.replace(cluster, name=f"{cluster.name} (modified)", **overrides)
    return cluster


def workload_from_args(args: argparse.Namespace) -> Workload:
    if args.workload == "prefill":
        return Workload("prefill", args.batch, args.prompt, args.prompt // 2, args.microbatches)
    return Workload("decode", args.batch, 1, args.context, args.microbatches)


def cmd_plan_parallel(args: argparse.Namespace) -> int:
    try:
        arch = model_arch(args.model)
        cluster = cluster_from_args(args)
        workload = workload_from_args(args)
        if args.gpus < 1 or not 0 < args.efficiency <= 1:
            raise ValueError("--gpus must be >= 1 and --efficiency in (0, 1]")
        ranked = rank_layouts(arch, cluster, args.gpus, workload, args.efficiency)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.model}: {arch.num_parameters / 1e9:.1f}B parameters on {args.gpus} GPUs of "
          f"{cluster.name} ({cluster.gpus_per_node} per node; {cluster.source}); "
          f"{workload.name}: batch {workload.batch} x {workload.new_tokens} tokens, context "
          f"{workload.context}, {workload.microbatches} micro-batches")
    print("| rank | layout | step ms | tokens/s | utilization | memory/GPU GB | why |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for index, est in enumerate(ranked, 1):
        print(f"| {index} | {est.layout} | {est.step_s * 1e3:.1f} | {est.tokens_per_s:.0f} | "
              f"{est.utilization:.0%} | {est.memory_per_gpu / 1e9:.1f} | {explain(est, cluster)} |")
    return 0 if ranked and ranked[0].fits else 1
