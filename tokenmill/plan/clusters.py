"""Clusters and model shapes the parallel planner knows by name.

Device and link figures are vendors' published peak numbers (cited per preset); the
planner discounts compute by an efficiency factor (`--efficiency`), not the links.
Latencies are typical figures, not measured here: NVLink ~ a few microseconds per
message through NCCL, InfiniBand / RoCE ~ 5-10 microseconds plus switch hops
(TECHNIQUES.md section 7). `calibrated_local()` builds a "cluster" of this machine's
processes from `tokenmill bench collectives` fits, so predictions can be checked
against what runs here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tokenmill.plan.collective_cost import Link

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    flops: float  # peak dense 16-bit FLOP/s per device
    memory: float  # bytes per device
    memory_bandwidth: float  # bytes/s per device
    source: str = ""


CLUSTERS: dict[str, Cluster] = {
    # NVIDIA DGX A100 datasheet: 8x A100 80GB, NVLink 3 600 GB/s per GPU (300 GB/s each
    # way), 8x 200 Gb/s HDR InfiniBand (25 GB/s per GPU); A100: 312 TFLOP/s dense BF16,
    # 2.0 TB/s HBM2e.
    "dgx-a100": Cluster("dgx-a100", 8, Link(300 * GB, 3e-6), Link(25 * GB, 8e-6), 312e12,
                        80e9, 2.0e12, "NVIDIA DGX A100 and A100 datasheets"),
    # The same nodes over RoCEv2 at 200 Gb/s per GPU (the first report's cluster), with
    # the higher latency of Ethernet switching.
    "a100-roce": Cluster("a100-roce", 8, Link(300 * GB, 3e-6), Link(25 * GB, 15e-6),
                         312e12, 80e9, 2.0e12, "DGX A100 datasheet; RoCEv2 200 Gb/s"),
    # NVIDIA DGX H100 datasheet: NVLink 4 900 GB/s per GPU (450 GB/s each way), 8x 400
    # Gb/s NDR (50 GB/s per GPU); H100 SXM: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3.
    "dgx-h100": Cluster("dgx-h100", 8, Link(450 * GB, 2.5e-6), Link(50 * GB, 6e-6), 989e12,
                        80e9, 3.35e12, "NVIDIA DGX H100 and H100 datasheets"),
}

# Model shapes of the reports (config.json fields), for planning without a checkpoint.
MODEL_SHAPES: dict[str, dict] = {
    # GPT-3 175B (Brown et al. 2020, table 2.1): 96 layers, d_model 12288, 96 heads.
    "gpt3-175b": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                      vocab_size=50257, hidden_size=12288, intermediate_size=32768,
                      num_hidden_layers=96, num_attention_heads=96,
                      max_position_embeddings=2048),
    # Llama 2 70B (Touvron et al. 2023): 80 layers, 8192 wide, 64 heads, 8 KV heads.
    "llama2-70b": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                       vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, max_position_embeddings=4096),
}

CALIBRATION_FILE = "collectives-fit.json"


def calibration_path() -> Path:
    cache = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))
    return cache / CALIBRATION_FILE


def measure_local_device(threads: int = 1) -> tuple[float, float, float]:
    """(float32 GEMM FLOP/s, copy bandwidth in bytes/s, memory bytes) of one worker
    process with `threads` threads on this machine: the planner's local "device"."""
    import time

    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        source = torch.ones(64 * 2**20 // 4)  # 64 MiB: out of every cache
        target = torch.empty_like(source)
        gemm = copy = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            torch.mm(a, b)
            gemm = min(gemm, time.perf_counter() - started)
            started = time.perf_counter()
            target.copy_(source)
            copy = min(copy, time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 2 * 1024**3 / gemm, 2 * source.nbytes / copy, float(memory)


def calibrated_local(flops: float, memory_bandwidth: float, memory: float) -> Cluster | None:
    """This machine as a one-node cluster of processes, its link the backend all-reduce's
    fitted alpha and beta (`tokenmill bench collectives` writes them), or None before
    that benchmark has run here."""
    path = calibration_path()
    if not path.is_file():
        return None
    fit = json.loads(path.read_text())["backend"]
    link = Link(fit["beta_bytes_per_s"], fit["alpha_s"])
    return Cluster("local", fit.get("ranks", 2), link, link, flops, memory, memory_bandwidth,
                   f"fitted on this machine ({path})")
