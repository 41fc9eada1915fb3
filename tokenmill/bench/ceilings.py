"""The machine's physical limits, measured once and cached: memory bandwidth and fp32
matmul rate. Every benchmark reports its figures as a fraction of these.

Each is the best of what torch (MKL), NumPy (OpenBLAS) and oneDNN on a packed weight
(the engine's CPU linear method, tokenmill.layers.products) reach on the machine: on this
project's AMD hosts OpenBLAS streams a matrix-vector product faster than torch sums a
buffer, and oneDNN multiplies with AVX-512 where MKL and OpenBLAS do not; a ceiling
below what code demonstrably reaches would flatter every fraction."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from tokenmill.layers.isa import capped_isa
from tokenmill.layers.linear import Linear
from tokenmill.layers.products import product_policy
from tokenmill.layers.timing import cpu_signature, median_seconds

CACHE = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


@dataclass(frozen=True)
class Ceilings:
    bandwidth_gbs: float  # streaming read bandwidth, GB/s
    matmul_gflops: float  # fp32 GEMM rate, GFLOP/s (the best library's)
    threads: int
    machine: str
    # torch's own fp32 GEMM rate (MKL): what a plain PyTorch program, transformers
    # included, multiplies at.
    torch_matmul_gflops: float = 0.0

    def decode_roofline_s(self, bytes_per_token: float) -> float:
        return bytes_per_token / (self.bandwidth_gbs * 1e9)

    def compute_roofline_s(self, flops: float) -> float:
        return flops / (self.matmul_gflops * 1e9)


def packed_product(weight: torch.Tensor, setting: str = "onednn") -> Linear | None:
    """A Linear computing x @ weight.T through the engine's oneDNN (or native) method
    (the weight packed once, the plain copy released), or None where it is missing."""
    try:
        policy = product_policy(setting, torch.device("cpu"), torch.float32)
    except ValueError:
        return None
    layer = Linear(weight.shape[1], weight.shape[0])
    layer.set_method(policy.select("", layer))
    layer.weight.data = weight
    layer.method.finalize(layer)
    return layer


def measure_bandwidth(threads: int, size_mb: int = 512) -> float:
    """GB/s streaming a buffer far larger than the caches: the best of a torch
    reduction, an OpenBLAS matrix-vector product and one-row oneDNN and native products
    on packed matrices (all read-bound)."""
    torch.set_num_threads(threads)
    data = torch.randn(size_mb * 2**20 // 4)
    times = [median_seconds(lambda: data.sum(), 7)]
    matrix = data.numpy().reshape(-1, 4096)
    vector = np.ones(4096, dtype=np.float32)
    with threadpool_limits(limits=threads, user_api="blas"):
        times.append(median_seconds(lambda: matrix @ vector, 7))
    row = torch.ones(1, 4096)
    for setting in ("onednn", "native"):
        packed = packed_product(data.view(-1, 4096).clone(), setting)
        if packed is not None:
            with torch.inference_mode():
                times.append(median_seconds(lambda: packed(row), 7))  # noqa: B023
    return size_mb * 2**20 / min(times) / 1e9


def measure_matmul(threads: int, n: int = 2048) -> tuple[float, float]:
    """fp32 GEMM GFLOP/s on n x n matrices: (the best of torch, OpenBLAS, and oneDNN and
    the native kernel on packed weights; torch's own)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    times = [median_seconds(lambda: a @ b, 5)]
    an, bn = a.numpy(), b.numpy()
    with threadpool_limits(limits=threads, user_api="blas"):
        times.append(median_seconds(lambda: an @ bn, 5))
    for setting in ("onednn", "native"):
        packed = packed_product(b.t().contiguous(), setting)  # computes a @ b
        if packed is not None:
            with torch.inference_mode():
                times.append(median_seconds(lambda: packed(a), 5))  # noqa: B023
    return 2 * n**3 / min(times) / 1e9, 2 * n**3 / times[0] / 1e9


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")


def host_description() -> str:
    """The CPU model and the instruction sets the kernels care about, for a report's
    header ("Intel(R) Xeon(R) Processor; avx2 fma avx512f amx_tile"), the cap if any."""
    model_line, flags_line = cpu_signature().split("|")[:2]
    model = model_line.partition(":")[2].strip() or platform.machine()
    flags = set(flags_line.partition(":")[2].split())
    isa = " ".join(f for f in ISA_FLAGS if f in flags) or "ISA flags unknown"
    cap = capped_isa()
    return f"{model}; {isa}" + (f"; capped at {cap}" if cap else "")


def describe(ceilings: Ceilings) -> str:
    return (f"{ceilings.matmul_gflops:.1f} GFLOP/s fp32 GEMM, {ceilings.bandwidth_gbs:.1f} "
            f"GB/s read ({ceilings.threads} threads)")


def machine_ceilings(threads: int | None = None, refresh: bool = False) -> Ceilings:
    threads = threads or torch.get_num_threads()
    isa = capped_isa()  # --isa avx2: the capped libraries' ceilings are their own
    cap = f"-{isa}" if isa else ""
    path = CACHE / f"ceilings-v4-{platform.node()}-{threads}t{cap}.json"
    if path.is_file() and not refresh:
        return Ceilings(**json.loads(path.read_text()))
    before = torch.get_num_threads()
    try:
        best, torch_own = measure_matmul(threads)
        ceilings = Ceilings(measure_bandwidth(threads), best, threads,
                            f"{platform.machine()} {os.cpu_count()} cores"
                            + (f", capped at {isa}" if isa else ""), torch_own)
    finally:
        torch.set_num_threads(before)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(ceilings)))
    return ceilings
