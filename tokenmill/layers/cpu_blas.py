"""Matrix products on the CPU through NumPy's BLAS (OpenBLAS in NumPy's wheels).

PyTorch's CPU wheel multiplies float32 matrices with MKL, whose kernels on this
project's AMD hosts stream a weight for a one-row product at about 25 GB/s, while
OpenBLAS streams a decoder-shaped pass at about 52 GB/s on the same host and is
1.1-2x faster at 5-512 rows (`benchmarks/bench_cpu_blas.py`, docs/BENCHMARKS.md).
The weights stay torch parameters; NumPy sees the same memory (no copy), and the
product's result is handed back to torch the same way.

Two details make it pay:
- the two thread pools must not spin against each other: PyTorch's OpenMP workers
  busy-wait after every parallel region, and on a machine with as many threads as
  cores that starves OpenBLAS (measured: 2.5x slower than torch alone, 5x slower
  than OpenBLAS with torch on one thread). So during an engine step on this path
  torch runs its own (element-wise, attention) work on one thread
  (`single_torch_thread`) and OpenBLAS has the configured thread count.
- OpenBLAS handles the rows of a product in panels of eight, and a partial panel
  costs more than a full one: 2-7 rows take longer than 8, 12 longer than 16, 28
  longer than 32 (measured on the model shapes). Products of fewer than 64 rows
  whose last panel would hold 2-7 rows are padded with zero rows to a multiple of
  eight; the extra rows' results are dropped. Two or three rows go one at a time
  instead (matrix-vector products, each as fast as the one-row case: 2-3 of them
  cost less than a padded panel).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

PAD_TO = 8
PAD_BELOW = 64
PER_ROW_MAX = 3


def numpy_weight(weight: torch.Tensor, transposed: bool) -> np.ndarray:
    """NumPy view [in, out] of a weight stored [in, out] (transposed) or [out, in]."""
    view = weight.detach().numpy()
    return view if transposed else view.T


def padded_rows(n: int) -> int:
    """Rows OpenBLAS computes for an n-row product (see the module docstring)."""
    if n <= PER_ROW_MAX or n >= PAD_BELOW or n % PAD_TO < 2:
        return n
    return n + PAD_TO - n % PAD_TO


def matmul(x: torch.Tensor, weight: np.ndarray) -> torch.Tensor:
    """x [..., in] @ weight [in, out] with NumPy's BLAS; float32 CPU tensors only."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    padded = padded_rows(n)
    if 1 < n <= PER_ROW_MAX:
        out = torch.empty(n, weight.shape[1], dtype=rows.dtype)
        out_np, rows_np = out.numpy(), rows.numpy()
        for row in range(n):
            np.matmul(rows_np[row], weight, out=out_np[row])
    elif padded != n:
        grown = torch.zeros(padded, rows.shape[1], dtype=rows.dtype)
        grown[:n] = rows
        out = torch.from_numpy(grown.numpy() @ weight)[:n]
    else:
        out = torch.from_numpy(rows.numpy() @ weight)
    return out.reshape(*x.shape[:-1], weight.shape[1])


def wanted(setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the `cpu_blas` setting (auto / numpy / torch) routes products to NumPy."""
    eligible = device.type == "cpu" and dtype == torch.float32
    if setting == "numpy" and not eligible:
        raise ValueError(f"cpu_blas: 'numpy' needs a float32 model on the CPU, not "
                         f"{dtype} on {device.type}")
    return eligible and setting in ("auto", "numpy")


def attach(model: nn.Module) -> None:
    """Route the products of every module in `model` that can take NumPy's BLAS (those
    with a `use_numpy_blas` method: Linear, the MoE experts) through it; inference only."""
    for module in model.modules():
        use = getattr(module, "use_numpy_blas", None)
        if use is not None:
            use()


def set_blas_threads(threads: int) -> None:
    """Threads for NumPy's BLAS, process-wide."""
    from threadpoolctl import ThreadpoolController

    ThreadpoolController().select(user_api="blas", internal_api="openblas").limit(limits=threads)


@contextmanager
def single_torch_thread() -> Iterator[None]:
    """torch's own work on one thread for the duration (BLAS threads do the products),
    so torch's spinning OpenMP workers never compete with BLAS for the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
