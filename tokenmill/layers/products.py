"""Who multiplies matrices on this device: the `cpu_blas` setting resolved into a
product policy, which picks every Linear's method and says what a step needs around it.

    torch   PyTorch's own products: wide layers transposed on the CPU, plain elsewhere
    onednn  oneDNN on weights packed once at load
    numpy   NumPy's OpenBLAS; torch's own work then runs on one thread during a step,
            so the two thread pools never spin against each other (layers/cpu_blas.py)
    native  tokenmill's own kernel on weights packed once at load
            (layers/native_linear.py)
    auto    for float32 on the CPU, whichever of these was measured fastest on this
            host (layers/product_table.py: `tokenmill tune`, or a start-up probe)

The registry `LINEAR_METHODS` names every method the policies (and, later, weight
quantization and tensor parallelism) choose from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch

from tokenmill.layers import cpu_blas, fetch_distance, native_linear
from tokenmill.layers.linear import Linear, LinearSelector
from tokenmill.layers.linear_method import PLAIN, TRANSPOSED, LinearMethod
from tokenmill.layers.product_table import auto_choice, native_decode_rows

LINEAR_METHODS: dict[str, LinearMethod] = {
    method.name: method for method in (PLAIN, TRANSPOSED, cpu_blas.ONEDNN, cpu_blas.NUMPY,
                                       cpu_blas.NUMPY_TRANSPOSED, native_linear.NATIVE)
}


def register_linear_method(method: LinearMethod) -> None:
    if method.name in LINEAR_METHODS and LINEAR_METHODS[method.name] is not method:
        raise ValueError(f"a linear method named {method.name!r} is already registered")
    LINEAR_METHODS[method.name] = method


def is_wide(layer: Linear) -> bool:
    return layer.out_features > layer.in_features


class ProductPolicy:
    """torch's own products (the base policy)."""

    name = "torch"
    # Whether weights are repacked into a second form (a tied LM head, also read as the
    # embedding table, is then kept twice).
    repacks_weights = False
    # Whether its step confines torch to one thread (its BLAS has its own threads).
    confines_torch = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def select(self, prefix: str, layer: Linear) -> LinearMethod:
        transposed = self.device.type == "cpu" and is_wide(layer)
        return LINEAR_METHODS["transposed" if transposed else "plain"]

    def planned_weight_bytes(self, prefix: str, layer: Linear, dtype: torch.dtype) -> int:
        """Bytes the method `select` picks will keep for the layer's weight once loaded
        (memory plans ask this of a model built on the meta device): a repacked weight
        that is also read plain (a tied LM head) is kept twice."""
        copies = 2 if self.repacks_weights and layer.keep_weight else 1
        return copies * layer.out_features * layer.in_features * dtype.itemsize

    def configure_threads(self, num_threads: int) -> None:
        """Size the product library's own thread pool, if it has one."""

    def step_context(self) -> AbstractContextManager[None]:
        """What a step (propose or forward) runs inside."""
        return contextlib.nullcontext()

    def padded_rows(self, num_rows: int) -> int:
        """Rows the products compute for a num_rows-row product (padding included)."""
        return num_rows

    @property
    def selector(self) -> LinearSelector:
        return self.select


class OneDNNProducts(ProductPolicy):
    name = "onednn"
    repacks_weights = True

    def select(self, prefix: str, layer: Linear) -> LinearMethod:
        return LINEAR_METHODS["onednn"]

    def padded_rows(self, num_rows: int) -> int:
        return cpu_blas.onednn_rows(num_rows)


class NativeProducts(ProductPolicy):
    name = "native"  # the packed form is the only copy, a tied head's too

    def select(self, prefix: str, layer: Linear) -> LinearMethod:
        return LINEAR_METHODS["native"]

    def planned_weight_bytes(self, prefix: str, layer: Linear, dtype: torch.dtype) -> int:
        return native_linear.packed_bytes(layer, dtype)

    def configure_threads(self, num_threads: int) -> None:
        # Decode tiles or the wide tile at a decode step's rows, and how far ahead a few
        # rows' weights are fetched: measured on this host.
        native_linear.set_decode_rows(native_decode_rows(num_threads))
        fetch_distance.configure(num_threads)


class NumpyProducts(ProductPolicy):
    name = "numpy"
    confines_torch = True

    def select(self, prefix: str, layer: Linear) -> LinearMethod:
        return LINEAR_METHODS["numpy-transposed" if is_wide(layer) else "numpy"]

    def configure_threads(self, num_threads: int) -> None:
        cpu_blas.set_blas_threads(num_threads)

    @contextlib.contextmanager
    def step_context(self) -> Iterator[None]:
        with cpu_blas.single_torch_thread():
            yield

    def padded_rows(self, num_rows: int) -> int:
        return cpu_blas.padded_rows(num_rows)


# The float32 CPU product paths by `cpu_blas` name (beside "torch" and "auto").
CPU_POLICIES: dict[str, type[ProductPolicy]] = {
    policy.name: policy for policy in (OneDNNProducts, NumpyProducts, NativeProducts)}


def product_policy(setting: str, device: torch.device, dtype: torch.dtype) -> ProductPolicy:
    """The policy for the `cpu_blas` setting (auto / onednn / numpy / native / torch)."""
    eligible = device.type == "cpu" and dtype == torch.float32
    if setting in CPU_POLICIES and not eligible:
        raise ValueError(f"cpu_blas: {setting!r} needs a float32 model on the CPU, not "
                         f"{dtype} on {device.type}")
    if setting == "onednn" and not cpu_blas.onednn_available():
        raise ValueError("cpu_blas: 'onednn' needs a torch build with oneDNN (mkldnn)")
    if setting == "native" and not native_linear.available():
        raise ValueError("cpu_blas: 'native' needs its kernel compiled, and it could not "
                         "be (a C++ compiler and torch's headers; see the log)")
    if setting not in ("auto", "torch", *CPU_POLICIES):
        raise ValueError(f"cpu_blas: no CPU product path {setting!r}")
    if not eligible or setting == "torch":
        return ProductPolicy(device)
    if setting == "auto":
        setting = auto_choice()
        if setting == "torch":
            return ProductPolicy(device)
    return CPU_POLICIES[setting](device)
