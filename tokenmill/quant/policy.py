"""The product policy with weight quantization: quantizable layers that no exclusion
pattern names take the quantized method, every other layer the base policy's (oneDNN,
native, NumPy or torch), and everything a step needs around its products stays the
base's -- except under NumPy's, whose step confines torch to one thread for its BLAS
(and the quantized kernels with it): there the float layers take the native kernel
where it builds, and the step keeps torch's threads."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from fnmatch import fnmatchcase

import torch

from tokenmill.config import QuantConfig
from tokenmill.layers import native_linear
from tokenmill.layers.linear import Linear
from tokenmill.layers.linear_method import LinearMethod
from tokenmill.layers.products import LINEAR_METHODS, ProductPolicy, register_linear_method
from tokenmill.quant.methods import AwqLinearMethod, QuantizedLinearMethod, QuantScheme

logger = logging.getLogger(__name__)


def scheme_for(config: QuantConfig) -> QuantScheme:
    bits = 8 if config.quantization == "int8" else 4
    return QuantScheme(bits, config.group_size, config.quantization_method,
                       config.quantization_activations)


class WrappedProducts(ProductPolicy):
    """A base policy with some layers given another method (`override`): everything a
    step needs around its products (threads, row padding, step context) stays the
    base's while some layer keeps the base's method; with none left on it, a step is
    not confined and rows are not padded for a library no product uses. The other
    method's kernels (tokenmill's own, on torch's thread pool) run on one thread under
    a base that confines torch to one for its BLAS (NumPy's): int8 decode measured 1.6x
    slower so.
    So under such a base the layers not overridden (an excluded LM head, MoE routers)
    take the native float kernel, on torch's pool too, where it builds; where they keep
    the base's BLAS its context stays (unconfined, torch's and OpenBLAS's spinning
    threads fought: 1.4-1.6x slower than confined)."""

    def __init__(self, base: ProductPolicy, name: str) -> None:
        super().__init__(base.device)
        self.base = base
        self.name = f"{base.name}, {name}"
        self.repacks_weights = base.repacks_weights
        # The float layers' method in the base's stead, if any.
        self.float_method = (LINEAR_METHODS["native"] if base.confines_torch
                             and native_linear.available() else None)
        if self.float_method is not None:
            self.name = f"{self.name} (float layers native)"
        # Whether select gave any layer another method than the base's, and any the base's.
        self.overridden = self.kept_base = False

    def override(self, prefix: str, layer: Linear) -> QuantizedLinearMethod | None:
        raise NotImplementedError

    def select(self, prefix: str, layer: Linear) -> LinearMethod:
        method = self.override(prefix, layer) or self.float_method
        if method is None:
            self.kept_base = True
            return self.base.select(prefix, layer)
        self.overridden = True
        return method

    def planned_weight_bytes(self, prefix: str, layer: Linear, dtype: torch.dtype) -> int:
        method = self.override(prefix, layer)
        if method is not None:
            return method.planned_weight_bytes(layer)
        if self.float_method is not None:
            return native_linear.packed_bytes(layer, dtype)
        return self.base.planned_weight_bytes(prefix, layer, dtype)

    def configure_threads(self, num_threads: int) -> None:
        self.base.configure_threads(num_threads)

    @property
    def base_runs(self) -> bool:
        """Whether any product runs on the base's method (so before any select)."""
        return self.kept_base or not self.overridden

    def step_context(self) -> AbstractContextManager[None]:
        return self.base.step_context() if self.base_runs else nullcontext()

    def padded_rows(self, num_rows: int) -> int:
        return self.base.padded_rows(num_rows) if self.base_runs else num_rows


class QuantizedProducts(WrappedProducts):
    def __init__(self, base: ProductPolicy, method: QuantizedLinearMethod,
                 exclude: tuple[str, ...] = ()) -> None:
        super().__init__(base, method.name)
        self.method = method
        self.exclude = exclude
        # Input widths the scheme does not fit (logged once each).
        self._unfit: set[int] = set()

    def override(self, prefix: str, layer: Linear) -> QuantizedLinearMethod | None:
        if not layer.quantizable or any(fnmatchcase(prefix, p) for p in self.exclude):
            return None
        if not self.method.scheme.fits(layer.in_features):
            if layer.in_features not in self._unfit:
                self._unfit.add(layer.in_features)
                logger.warning("layers with %d input columns (%s, ...) keep float weights: "
                               "%s does not fit them", layer.in_features, prefix,
                               self.method.name)
            return None
        return self.method


def quantized_products(config: QuantConfig, base: ProductPolicy,
                       dtype: torch.dtype) -> ProductPolicy:
    """`base` itself when quantization is off; otherwise the quantizing policy.

    Raises ValueError where the kernels do not apply (they take float32 activations
    on the CPU)."""
    if config.quantization == "none":
        if config.quantization_activations != "float32":
            raise ValueError("quantization_activations: int8 activations need quantized "
                             "weights (--quantization int8 or int4, or a pre-quantized "
                             "checkpoint)")
        return base
    if base.device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"quantization: {config.quantization!r} runs float32 models on "
                         f"the CPU, not {dtype} on {base.device.type}")
    scheme = scheme_for(config)
    # Methods are stateless: engines with the same scheme share the registered one.
    method = LINEAR_METHODS.get(scheme.name)
    if method is None:
        method_class = AwqLinearMethod if scheme.algorithm == "awq" else QuantizedLinearMethod
        method = method_class(scheme)
        register_linear_method(method)
    return QuantizedProducts(base, method, config.exclude_patterns)
