"""Loading a pre-quantized checkpoint (model/prequantized.py) as it was saved: the layers
it holds quantized take a method that copies the saved codes, scales and offsets (and
AWQ's input scale) into place and packs them for the kernels, with nothing quantized
again and no float weight materialised; products, memory plans and everything else
are the quantizing methods' own (methods.py), so the loaded model computes exactly
what the same settings quantizing at load compute.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from tokenmill.config import QuantConfig
from tokenmill.layers.block_tensor import BlockTensor
from tokenmill.layers.linear import Linear
from tokenmill.layers.products import LINEAR_METHODS, ProductPolicy, register_linear_method
from tokenmill.layers.quantized_tensor import SavedQuantTensor, unpack_nibbles
from tokenmill.quant.formats import QuantizedWeight
from tokenmill.quant.methods import AwqLinearMethod, QuantizedLinearMethod, QuantScheme
from tokenmill.quant.policy import WrappedProducts, scheme_for

logger = logging.getLogger(__name__)


class SavedLinearMethod(QuantizedLinearMethod):
    """A layer's saved codes, staged as the file holds them (4-bit codes two a byte)
    until finalize packs them for the kernels."""

    def __init__(self, scheme: QuantScheme) -> None:
        super().__init__(scheme)
        self.name = f"saved-{scheme.name}"

    def create_weights(self, layer: Linear) -> None:
        # No float weight: the codes wait in buffers (materialised with the model).
        layer.weight = torch.nn.Parameter(torch.empty(0))
        bits, rows, columns = self.scheme.bits, layer.out_features, layer.in_features
        groups = columns // self.scheme.group_for(columns)
        codes = (torch.empty(rows, columns, dtype=torch.int8) if bits == 8
                 else torch.empty(rows, columns // 2, dtype=torch.uint8))
        layer.register_buffer("staged_codes", codes, persistent=False)
        layer.register_buffer("staged_scales", torch.empty(rows, groups), persistent=False)
        if bits == 4:
            layer.register_buffer("staged_offsets", torch.empty(rows, groups),
                                  persistent=False)
        if self.scheme.algorithm == "awq":
            layer.register_buffer("staged_input_scale", torch.empty(columns),
                                  persistent=False)

    def takes_blocks(self, tensor: BlockTensor | SavedQuantTensor) -> bool:
        return isinstance(tensor, SavedQuantTensor)

    def load_weight(self, layer: Linear, tensor, rows: slice) -> None:
        if not isinstance(tensor, SavedQuantTensor):
            raise ValueError(f"{self.name} loads saved codes only, not a float weight (a "
                             "fused layer's parts must all be saved quantized)")
        expected = (rows.stop - rows.start, layer.in_features)
        if tensor.shape != expected:
            raise ValueError(f"shape {tensor.shape} does not fit {expected}")
        group = self.scheme.group_for(layer.in_features)
        if tensor.bits != self.scheme.bits or tensor.group_size != group:
            raise ValueError(f"saved {tensor.bits}-bit codes with group {tensor.group_size} "
                             f"do not fit {self.scheme.name} (group {group})")
        if (tensor.input_scale is not None) != (self.scheme.algorithm == "awq"):
            raise ValueError(f"an AWQ input scale is saved exactly with awq weights "
                             f"({self.scheme.name})")
        layer.staged_codes[rows] = tensor.codes
        layer.staged_scales[rows] = tensor.scales
        if tensor.offsets is not None:
            layer.staged_offsets[rows] = tensor.offsets
        if tensor.input_scale is not None:
            # One scale per input column of the whole (fused) layer: every part has it.
            layer.staged_input_scale.copy_(tensor.input_scale)

    def finalize(self, layer: Linear) -> None:
        codes = layer.staged_codes
        offsets = layer.staged_offsets if self.scheme.bits == 4 else None
        weight = QuantizedWeight(self.scheme.bits, self.scheme.group_for(layer.in_features),
                                 unpack_nibbles(codes) if self.scheme.bits == 4 else codes,
                                 layer.staged_scales, offsets)
        if self.scheme.algorithm == "awq":
            layer.input_scale = layer.staged_input_scale
            del layer.staged_input_scale
        self.set_quantized(layer, weight)
        del layer.staged_codes, layer.staged_scales
        if offsets is not None:
            del layer.staged_offsets


class SavedAwqLinearMethod(SavedLinearMethod, AwqLinearMethod):
    """Saved AWQ codes: products scale the activation by the saved input scale
    (AwqLinearMethod's); calibration skips the layer, which is quantized already."""


def saved_method(scheme: QuantScheme) -> SavedLinearMethod:
    name = f"saved-{scheme.name}"
    if name not in LINEAR_METHODS:
        method_class = SavedAwqLinearMethod if scheme.algorithm == "awq" else SavedLinearMethod
        register_linear_method(method_class(scheme))
    return LINEAR_METHODS[name]


def check_request(requested: QuantConfig, saved: QuantConfig) -> None:
    """A pre-quantized checkpoint loads as saved: an engine may leave quantization off or
    repeat the saved settings, never ask for others (that would mean quantizing codes
    again). Raises ValueError naming the first setting that differs."""
    if requested.quantization == "none":
        return
    fields = (("quantization", requested.quantization, saved.quantization),
              ("quantization_method", requested.quantization_method,
               saved.quantization_method),
              ("quantization_group_size", requested.group_size, saved.group_size),
              ("quantization_exclude", requested.exclude_patterns, saved.exclude_patterns))
    for field, asked, held in fields:
        if asked != held:
            raise ValueError(
                f"{field}: the checkpoint is pre-quantized ({scheme_for(saved).name}, "
                f"{field} {held!r}) and is loaded as saved; {asked!r} asks for other "
                "weights: leave --quantization unset, or quantize the float checkpoint")


class SavedProducts(WrappedProducts):
    """The layers a pre-quantized checkpoint holds quantized take the saved method."""

    def __init__(self, base: ProductPolicy, method: SavedLinearMethod,
                 layers: set[str]) -> None:
        super().__init__(base, method.name)
        self.method = method
        self.layers = layers

    def override(self, prefix: str, layer: Linear) -> SavedLinearMethod | None:
        return self.method if prefix in self.layers else None


def saved_products(settings: dict, layers: set[str], base: ProductPolicy,
                   dtype: torch.dtype, requested: QuantConfig) -> ProductPolicy:
    """The policy for a pre-quantized checkpoint saved with `settings` (QuantConfig's
    fields) holding `layers` quantized. Raises ValueError when the engine asks for
    other quantization settings, or where the kernels do not run (they take float32
    activations on the CPU)."""
    saved = QuantConfig(**settings)
    check_request(requested, saved)
    if base.device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"model: a pre-quantized checkpoint ({scheme_for(saved).name}) "
                         f"runs float32 on the CPU, not {dtype} on {base.device.type}")
    # The activations are the engine's choice, not the checkpoint's.
    scheme = dataclasses.replace(scheme_for(saved),
                                 activations=requested.quantization_activations)
    logger.info("pre-quantized checkpoint: %d layers load %s as saved", len(layers),
                scheme.name)
    return SavedProducts(base, saved_method(scheme), layers)
