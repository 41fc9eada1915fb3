"""Matrix products on the CPU: oneDNN on pre-packed weights, or NumPy's OpenBLAS.

`auto` (float32 on the CPU) picks oneDNN where torch is built with it. Its inner-product
kernels run on weights reordered once, when the model loads, into the blocked layout they
read (`torch.ops.mkldnn._reorder_linear_weight`): a call neither packs nor copies the
weight, so a few-row product streams it at the memory's pace and a many-row one runs
with the widest vector units the CPU has (AVX-512 where present). Measured on a
decoder-shaped pass of the 0.5B model's weights with 2 threads, against OpenBLAS:
1.0-1.5x at one row (both bandwidth-bound), 1.7-2.3x at 2-1024 rows
(`benchmarks/bench_cpu_blas.py`, docs/BENCHMARKS.md). It runs on torch's own thread
pool, so nothing competes with torch's other work. The packed copy replaces the
plain weight (the method frees it) unless the plain one is read elsewhere: a tied
LM head's weight is also the embedding table. Row counts are padded to a bounded set
of sizes (`onednn_rows`).

NumPy's OpenBLAS (`numpy`) is the fallback where oneDNN is missing. PyTorch's CPU
wheel multiplies float32 matrices with MKL, whose kernels on this project's AMD
hosts stream a weight for a one-row product at about 25 GB/s, while OpenBLAS
streams a decoder-shaped pass at about 52 GB/s on the same host and is 1.1-2x
faster at 5-512 rows (`benchmarks/bench_cpu_blas.py`, docs/BENCHMARKS.md).
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

from tokenmill.layers.linear_method import (
    Linear,
    LinearMethod,
    PlainLinearMethod,
    TransposedLinearMethod,
)

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


# Rows the packed layout is chosen for; measured alike for 1-1024-row products.
PACK_ROWS_HINT = 1024


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's pre-packed inner product."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018 (raises when absent)
        torch.ops.mkldnn._linear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def onednn_weight(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """oneDNN's packed copy of a weight stored [in, out] (transposed) or [out, in]."""
    plain = weight.detach()
    plain = (plain.t() if transposed else plain).contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(plain, PACK_ROWS_HINT)


def onednn_rows(n: int) -> int:
    """Rows oneDNN computes for an n-row product: n rounded up to a bucket.

    oneDNN builds (JIT-compiles) a kernel for every new input shape: ~0.4 ms, ten
    times a small product, and its cache holds 1024. A server sees every row count
    from 1 to the token budget, so rows are padded with zeros to a bounded set of
    sizes (about 40 per weight shape up to 2048): exact up to 8, then multiples of 8
    up to 64 (few-row products stream the weight: extra rows cost little), of 32 up
    to 512 and of 128 beyond (at most ~10% extra work there)."""
    for limit, step in ((8, 1), (64, 8), (512, 32)):
        if n <= limit:
            return -(-n // step) * step
    return -(-n // 128) * 128


def onednn_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W.T + bias, W packed by `onednn_weight`; float32 CPU tensors only."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    padded = onednn_rows(n)
    if padded != n:
        grown = rows.new_zeros(padded, rows.shape[1])
        grown[:n] = rows
        rows = grown
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out[:n].reshape(*x.shape[:-1], out.shape[-1])


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


class OneDNNLinearMethod(PlainLinearMethod):
    """Loads into the checkpoint layout, then packs once for oneDNN (inference only)."""

    name = "onednn"

    def finalize(self, layer: Linear) -> None:
        layer.packed_weight = onednn_weight(layer.weight, transposed=False)
        if not layer.keep_weight:
            # One copy of the weight from here on: the packed one.
            layer.weight.data = layer.weight.data.new_empty(0)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, layer.packed_weight, layer.bias)

    def checkpoint_weight(self, layer: Linear) -> torch.Tensor:
        if layer.weight.numel():
            return layer.weight.detach()
        return layer.packed_weight.to_dense()  # the packed copy unpacks exactly

    def weight_bytes(self, layer: Linear) -> int:
        packed = layer.packed_weight
        return super().weight_bytes(layer) + packed.numel() * packed.element_size()


class NumpyLinearMethod(LinearMethod):
    """NumPy's BLAS on a zero-copy [in, out] view of the torch weight (inference only).

    The weight keeps the torch layout its shape streams fastest in (transposed: wide
    layers, see TransposedLinearMethod); NumPy reads it either way without a copy."""

    def __init__(self, transposed: bool) -> None:
        self.layout = TransposedLinearMethod() if transposed else PlainLinearMethod()
        self.transposed = transposed
        self.name = "numpy-transposed" if transposed else "numpy"

    def create_weights(self, layer: Linear) -> None:
        self.layout.create_weights(layer)

    def load_weight(self, layer: Linear, tensor: torch.Tensor, rows: slice) -> None:
        self.layout.load_weight(layer, tensor, rows)

    def finalize(self, layer: Linear) -> None:
        layer.blas_weight = numpy_weight(layer.weight, self.transposed)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = matmul(x, layer.blas_weight)
        return out + layer.bias if layer.bias is not None else out

    def embedding(self, layer: Linear, token_ids: torch.Tensor) -> torch.Tensor:
        return self.layout.embedding(layer, token_ids)

    def checkpoint_weight(self, layer: Linear) -> torch.Tensor:
        return self.layout.checkpoint_weight(layer)


ONEDNN = OneDNNLinearMethod()
NUMPY = NumpyLinearMethod(transposed=False)
NUMPY_TRANSPOSED = NumpyLinearMethod(transposed=True)
