"""Quantized weights as `LinearMethod`s: a layer loads its float checkpoint weight,
is quantized and packed once the checkpoint is in (`finalize`), and from then on keeps
only the codes, scales and offsets; products go through the kernel its row count's
class was measured fastest with (kernels.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.layers.linear_method import Linear, LinearMethod
from tokenmill.quant.awq import InputStats, quantize_awq
from tokenmill.quant.formats import (
    QuantizedWeight,
    check_group_size,
    dequantize,
    quantize_int4_rtn,
    quantize_int8,
)
from tokenmill.quant.hqq import quantize_int4_hqq
from tokenmill.quant.kernels import KernelTable, kernel_table
from tokenmill.quant.packing import pack, packed_bytes, unpack, unpack_rows


@dataclass(frozen=True)
class QuantScheme:
    """How weights are quantized: bits, input columns per scale (None: one scale per
    output channel, int8 only) and the algorithm choosing scales and zero points."""

    bits: int
    group_size: int | None
    algorithm: str = "rtn"
    # float32 or int8: what the products round the activations to (kernels.py).
    activations: str = "float32"

    @property
    def name(self) -> str:
        group = f"-g{self.group_size}" if self.group_size else ""
        algorithm = f"-{self.algorithm}" if self.bits == 4 else ""
        activations = "-a8" if self.activations == "int8" else ""
        return f"int{self.bits}{algorithm}{group}{activations}"

    def group_for(self, in_features: int) -> int:
        return self.group_size or in_features

    def fits(self, in_features: int) -> bool:
        """Whether a layer with this many input columns can take the scheme."""
        try:
            check_group_size(in_features, self.group_for(in_features))
        except ValueError:
            return False
        return self.bits == 8 or in_features % 2 == 0

    def quantize(self, weight: torch.Tensor) -> QuantizedWeight:
        if self.bits == 8:
            return quantize_int8(weight, self.group_size)
        if self.algorithm == "awq":
            raise ValueError("awq quantizes from calibration activations "
                             "(AwqLinearMethod.calibrate)")
        if self.algorithm == "hqq":
            return quantize_int4_hqq(weight, self.group_for(weight.shape[1]))
        return quantize_int4_rtn(weight, self.group_for(weight.shape[1]))


class QuantizedLinearMethod(LinearMethod):
    """int8 / int4 codes; float32 or int8 activations (inference only)."""

    def __init__(self, scheme: QuantScheme, kernels: KernelTable | None = None) -> None:
        self.scheme = scheme
        self.name = scheme.name
        # Measured (or read from the cache) at the first product, so that building a
        # memory plan compiles and times nothing.
        self._kernels = kernels

    @property
    def kernels(self) -> KernelTable:
        if self._kernels is None:
            self._kernels = kernel_table(self.scheme.bits, activations=self.scheme.activations)
        return self._kernels

    def finalize(self, layer: Linear) -> None:
        self.set_quantized(layer, self.scheme.quantize(layer.weight.detach()))

    @staticmethod
    def set_quantized(layer: Linear, weight: QuantizedWeight) -> None:
        """Keep `weight` packed as the layer's only weight: a tied embedding reads
        its rows from the codes too, so no float copy is kept for it."""
        layer.quantized = pack(weight)
        layer.weight.data = layer.weight.data.new_empty(0)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, layer.quantized, layer.bias)

    def embedding(self, layer: Linear, token_ids: torch.Tensor) -> torch.Tensor:
        return dequantize(unpack_rows(layer.quantized, token_ids.reshape(-1))).reshape(
            *token_ids.shape, layer.in_features)

    def checkpoint_weight(self, layer: Linear) -> torch.Tensor:
        """The dequantized weight [out, in]."""
        return dequantize(unpack(layer.quantized))

    def weight_bytes(self, layer: Linear) -> int:
        return layer.quantized.nbytes + super().weight_bytes(layer)

    def planned_weight_bytes(self, layer: Linear) -> int:
        """What weight_bytes will report once the layer is loaded and finalized."""
        return packed_bytes(self.scheme.bits, layer.out_features, layer.in_features,
                            self.scheme.group_for(layer.in_features))


class AwqLinearMethod(QuantizedLinearMethod):
    """int4 codes of W diag(s) and the activation scale 1/s per input column (awq.py).

    Until `calibrate` the layer keeps its float weight and multiplies in float, so the
    worker can run the float model over the calibration text first."""

    def finalize(self, layer: Linear) -> None:
        return None  # quantized by calibrate, once activations are known

    def calibrate(self, layer: Linear, stats: InputStats) -> None:
        quantized, inverse = quantize_awq(layer.weight.detach(),
                                          self.scheme.group_for(layer.in_features), stats)
        layer.input_scale = inverse
        self.set_quantized(layer, quantized)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(layer, "quantized"):
            return F.linear(x, layer.weight, layer.bias)
        return self.kernels.linear(x * layer.input_scale, layer.quantized, layer.bias)

    def embedding(self, layer: Linear, token_ids: torch.Tensor) -> torch.Tensor:
        if not hasattr(layer, "quantized"):  # a tied embedding, while calibrating
            return LinearMethod.embedding(self, layer, token_ids)
        return super().embedding(layer, token_ids) * layer.input_scale

    def checkpoint_weight(self, layer: Linear) -> torch.Tensor:
        return super().checkpoint_weight(layer) * layer.input_scale

    def weight_bytes(self, layer: Linear) -> int:
        scale = layer.input_scale.numel() * 4 if hasattr(layer, "input_scale") else 0
        return super().weight_bytes(layer) + scale

    def planned_weight_bytes(self, layer: Linear) -> int:
        return super().planned_weight_bytes(layer) + 4 * layer.in_features
