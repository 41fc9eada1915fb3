"""The machine's physical limits, measured once and cached: memory bandwidth and fp32
matmul rate. Every benchmark reports its figures as a fraction of these.

Each is the best of what torch (MKL) and NumPy (OpenBLAS) reach on the machine: on
this project's AMD hosts OpenBLAS streams a matrix-vector product faster than torch
sums a buffer, and a ceiling below what code demonstrably reaches would flatter
every fraction."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from threadpoolctl import threadpool_limits

CACHE = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


@dataclass(frozen=True)
class Ceilings:
    bandwidth_gbs: float  # streaming read bandwidth, GB/s
    matmul_gflops: float  # fp32 GEMM rate, GFLOP/s
    threads: int
    machine: str

    def decode_roofline_s(self, bytes_per_token: float) -> float:
        return bytes_per_token / (self.bandwidth_gbs * 1e9)

    def compute_roofline_s(self, flops: float) -> float:
        return flops / (self.matmul_gflops * 1e9)


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_bandwidth(threads: int, size_mb: int = 512) -> float:
    """GB/s streaming a buffer far larger than the caches: the best of a torch
    reduction and an OpenBLAS matrix-vector product (both read-bound)."""
    torch.set_num_threads(threads)
    data = torch.randn(size_mb * 2**20 // 4)
    torch_s = _median_time(lambda: data.sum(), 7)
    matrix = data.numpy().reshape(-1, 4096)
    vector = np.ones(4096, dtype=np.float32)
    with threadpool_limits(limits=threads, user_api="blas"):
        blas_s = _median_time(lambda: matrix @ vector, 7)
    return data.numel() * 4 / min(torch_s, blas_s) / 1e9


def measure_matmul(threads: int, n: int = 2048) -> float:
    """fp32 GEMM GFLOP/s: the best of torch and OpenBLAS on n x n matrices."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch_s = _median_time(lambda: a @ b, 5)
    an, bn = a.numpy(), b.numpy()
    with threadpool_limits(limits=threads, user_api="blas"):
        blas_s = _median_time(lambda: an @ bn, 5)
    return 2 * n**3 / min(torch_s, blas_s) / 1e9


def machine_ceilings(threads: int | None = None, refresh: bool = False) -> Ceilings:
    threads = threads or torch.get_num_threads()
    path = CACHE / f"ceilings-v2-{platform.node()}-{threads}t.json"
    if path.is_file() and not refresh:
        return Ceilings(**json.loads(path.read_text()))
    before = torch.get_num_threads()
    try:
        ceilings = Ceilings(measure_bandwidth(threads), measure_matmul(threads), threads,
                            f"{platform.machine()} {os.cpu_count()} cores")
    finally:
        torch.set_num_threads(before)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(ceilings)))
    return ceilings
