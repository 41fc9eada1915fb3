"""GGUF block formats kept quantized: Q8_0, Q4_0, Q4_1 and Q4_K are exactly this
package's int8 / int4 forms at group 32, so a GGUF weight in one of them is decoded
into codes, scales and offsets at load (no float copy, no requantization) and runs on
the same kernels. Other formats (Q5_*, Q6_K, ...) are dequantized at load.

    Q8_0  34 B per 32 weights: float16 d, 32 int8 q          w = q * d
    Q4_0  18 B: float16 d, 16 bytes of nibbles               w = q * d - 8 d
    Q4_1  20 B: float16 d, float16 m, 16 bytes               w = q * d + m
    Q4_K  144 B per 256: float16 d, dmin; 8 six-bit (scale, min) pairs; 128 bytes
          of nibbles; sub-block j of 32:                      w = q * d sc_j - dmin m_j
Nibble order: Q4_0 / Q4_1 hold weights j (low nibble) and j + 16 (high) of a block in
byte j; Q4_K holds, per 64 weights, weights l and l + 32 in byte l.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.layers.block_tensor import BlockTensor
from tokenmill.layers.linear import Linear
from tokenmill.layers.products import LINEAR_METHODS, ProductPolicy, register_linear_method
from tokenmill.quant.formats import QuantizedWeight
from tokenmill.quant.methods import QuantizedLinearMethod, QuantScheme
from tokenmill.quant.policy import WrappedProducts

logger = logging.getLogger(__name__)

GROUP = 32
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144}


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block, as float32 [rows, blocks]."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles_by_halves(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes: the n low nibbles, then the n high ones."""
    return torch.cat((packed & 15, packed >> 4), dim=-1)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (as float32)."""
    low, high = packed[..., 0:4], packed[..., 4:8]
    last = packed[..., 8:12]
    scales = torch.cat((low & 63, (last & 15) | ((low >> 6) << 4)), dim=-1)
    mins = torch.cat((high & 63, (last >> 4) | ((high >> 6) << 4)), dim=-1)
    return scales.float(), mins.float()


def decode_blocks(tensor: BlockTensor) -> QuantizedWeight:
    """The codes, scales and offsets (group 32) a Q8_0 / Q4_0 / Q4_1 / Q4_K tensor holds."""
    rows, columns = tensor.shape
    blocks = tensor.data.reshape(rows, -1, BLOCK_BYTES[tensor.format])
    if tensor.format == "Q8_0":
        codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, columns)
        return QuantizedWeight(8, GROUP, codes, _halves(blocks, 0))
    if tensor.format in ("Q4_0", "Q4_1"):
        scale = _halves(blocks, 0)
        offset = -8 * scale if tensor.format == "Q4_0" else _halves(blocks, 2)
        packed = blocks[..., 2 if tensor.format == "Q4_0" else 4:]
        codes = _nibbles_by_halves(packed).reshape(rows, columns)
        return QuantizedWeight(4, GROUP, codes, scale, offset)
    scale, minimum = _halves(blocks, 0), _halves(blocks, 2)
    sub_scales, sub_mins = _k_scales(blocks[..., 4:16])
    chunks = blocks[..., 16:].reshape(rows, -1, 4, 32)  # 4 x 64 weights per block
    codes = torch.stack((chunks & 15, chunks >> 4), dim=3).reshape(rows, columns)
    return QuantizedWeight(4, GROUP, codes, (scale[..., None] * sub_scales).reshape(rows, -1),
                           (-minimum[..., None] * sub_mins).reshape(rows, -1))


class BlockLinearMethod(QuantizedLinearMethod):
    """A GGUF block format kept as it is: the checkpoint's blocks are decoded into the
    layer's codes at load; nothing is quantized here."""

    def __init__(self, format: str) -> None:
        super().__init__(QuantScheme(8 if format == "Q8_0" else 4, GROUP, format.lower()))
        self.format = format
        self.name = f"gguf-{format.lower()}"

    def create_weights(self, layer: Linear) -> None:
        # No float weight: the decoded blocks wait in buffers (materialised with the
        # model) until finalize packs them.
        layer.weight = torch.nn.Parameter(torch.empty(0))
        rows, columns = layer.out_features, layer.in_features
        codes_dtype = torch.int8 if self.scheme.bits == 8 else torch.uint8
        layer.register_buffer("staged_codes", torch.empty(rows, columns, dtype=codes_dtype),
                              persistent=False)
        for name in ("staged_scales", "staged_offsets"):
            layer.register_buffer(name, torch.empty(rows, columns // GROUP), persistent=False)

    def takes_blocks(self, tensor: BlockTensor) -> bool:
        return tensor.format == self.format

    def load_weight(self, layer: Linear, tensor, rows: slice) -> None:
        if not isinstance(tensor, BlockTensor) or tensor.format != self.format:
            raise ValueError(f"{self.name} loads {self.format} blocks only")
        decoded = decode_blocks(tensor)
        if layer.staged_codes[rows].shape != decoded.codes.shape:
            raise ValueError(f"shape {tuple(decoded.codes.shape)} does not fit "
                             f"{tuple(layer.staged_codes[rows].shape)}")
        layer.staged_codes[rows] = decoded.codes
        layer.staged_scales[rows] = decoded.scales
        if decoded.offsets is not None:
            layer.staged_offsets[rows] = decoded.offsets

    def finalize(self, layer: Linear) -> None:
        offsets = layer.staged_offsets if self.scheme.bits == 4 else None
        self.set_quantized(layer, QuantizedWeight(self.scheme.bits, GROUP, layer.staged_codes,
                                                  layer.staged_scales, offsets))
        del layer.staged_codes, layer.staged_scales, layer.staged_offsets


def block_method(format: str) -> BlockLinearMethod:
    name = f"gguf-{format.lower()}"
    if name not in LINEAR_METHODS:
        register_linear_method(BlockLinearMethod(format))
    return LINEAR_METHODS[name]


class BlockProducts(WrappedProducts):
    """Layers whose checkpoint tensors all share a kept block format take its method."""

    def __init__(self, base: ProductPolicy, layer_formats: dict[str, set[str]]) -> None:
        super().__init__(base, "gguf blocks")
        self.kept = {prefix: next(iter(formats)) for prefix, formats in layer_formats.items()
                     if len(formats) == 1 and next(iter(formats)) in BLOCK_BYTES}
        dequantized = {prefix: formats for prefix, formats in layer_formats.items()
                       if prefix not in self.kept and formats - {"F32", "F16", "BF16"}}
        if self.kept:
            logger.info("GGUF: %d layers keep their blocks (%s)", len(self.kept),
                        ", ".join(sorted(set(self.kept.values()))))
        if dequantized:
            logger.info("GGUF: %d layers are dequantized to float at load (formats %s "
                        "have no kernel, or a fused layer mixes formats)", len(dequantized),
                        ", ".join(sorted(set().union(*dequantized.values()))))

    def override(self, prefix: str, layer: Linear) -> BlockLinearMethod | None:
        return block_method(self.kept[prefix]) if prefix in self.kept else None


def block_products(base: ProductPolicy, layer_formats: dict[str, set[str]],
                   dtype: torch.dtype) -> ProductPolicy:
    """`base` with GGUF's kept formats on top (base itself when nothing is kept, or
    where the kernels do not run: they take float32 on the CPU)."""
    if not layer_formats or base.device.type != "cpu" or dtype != torch.float32:
        return base
    return BlockProducts(base, layer_formats)
