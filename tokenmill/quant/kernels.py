"""The products of a packed quantized weight, and the kernel that serves each row count.

Two kernels compute x [rows, in] @ W^T + b for a PackedWeight:

    native      csrc/qlinear.cpp, compiled for this CPU (-march=native) at first use
                into the cache directory: codes are widened and scaled in registers,
                activations stay float32. One row sums each group's codes unscaled in
                four accumulators and scales per group; more rows dequantize each
                column once and share it between up to 8 (AVX-512) or 4 rows.
    dequantize  the float32 weight rebuilt in torch for the call, then torch's GEMM:
                the fallback where nothing can be compiled, and a candidate for long
                prefills, where the product's arithmetic dwarfs rebuilding the weight.

Which kernel serves which row count is measured on the machine (`KernelTable`,
cached per CPU, torch version and thread count), not assumed from one host.

With int8 activations (`--quantization-activations int8`, W8A8 / W4A8) one kernel
serves every row count: csrc/qlinear_a8.cpp quantizes each row per 32 columns and
multiplies with AVX-512 VNNI integer dot products (llama.cpp's approach: its Q8_0 /
Q4_K products quantize activations too). It changes numerics (the activations are
rounded), so it is a choice the user makes, not one a measurement makes; on a CPU
without VNNI, or a layer whose widths are not multiples of 32, the float32 kernels
serve.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

from tokenmill.layers.native import build_extension, build_key
from tokenmill.layers.timing import CACHE, median_seconds
from tokenmill.quant.formats import QuantizedWeight, quantize_int4_rtn, quantize_int8
from tokenmill.quant.packing import LANES, PackedWeight, pack

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "qlinear.cpp"
SOURCE_A8 = Path(__file__).resolve().parent / "csrc" / "qlinear_a8.cpp"
ACTIVATION_CHUNK = 32  # activation columns per int8 scale (qlinear_a8.cpp)
KERNELS = ("native", "dequantize")  # the float32-activation kernels a table measures
# Row-count classes a kernel is chosen for: a product of n rows takes the first class
# whose bound is >= n (decode at batch 1, small and large decode batches, prefill).
ROW_CLASSES = (1, 8, 32, 256)


@functools.cache  # (no arguments: a lookup per product costs nothing)
def native_library():
    """The compiled kernels (built once per CPU and torch version), or None where they
    cannot be built: the dequantize kernel serves then."""
    return build_extension("qlinear", SOURCE)


@functools.cache
def a8_library():
    """The int8-activation kernels, or None where they cannot be built or this CPU
    lacks AVX-512 VNNI and VBMI."""
    library = build_extension("qlinear_a8", SOURCE_A8)
    return library if library is not None and library.supported() else None


def a8_fits(weight: PackedWeight) -> bool:
    return (weight.in_features % ACTIVATION_CHUNK == 0
            and weight.group_size % ACTIVATION_CHUNK == 0)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the int8-activation kernels see it: each row's 32-column chunks rounded to
    int8 codes times max |x| / 127 (the reference their tests compare against)."""
    chunks = x.reshape(-1, ACTIVATION_CHUNK)
    amax = chunks.abs().amax(dim=1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(chunks * inverse).clamp(-127, 127)
    return (codes * (amax / 127.0)).reshape(x.shape)


def a8_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + b with x quantized to int8 per 32 columns (W8A8 / W4A8)."""
    return a8_library().quantized_linear_a8(
        _rows(x), weight.codes, weight.scales, weight.offsets, bias, weight.out_features,
        weight.group_size, weight.bits == 4)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.float32:
        raise ValueError(f"quantized products take float32 activations, not {rows.dtype}")
    return rows.contiguous()


def native_linear(x: torch.Tensor, weight: PackedWeight,
                  bias: torch.Tensor | None) -> torch.Tensor:
    library = native_library()
    if library is None:
        return dequantize_linear(x, weight, bias)
    return library.quantized_linear(_rows(x), weight.codes, weight.scales, weight.offsets,
                                    bias, weight.out_features, weight.group_size,
                                    weight.bits == 4)


def dequantized_transposed(weight: PackedWeight) -> torch.Tensor:
    """The float32 weight as [in, out] (the packed blocks need one transpose to it)."""
    codes = weight.codes
    if weight.bits == 4:
        codes = torch.stack((codes & 15, codes >> 4), dim=2).reshape(
            codes.shape[0], -1, LANES)
    blocks, in_features = codes.shape[0], codes.shape[1]
    values = codes.float().reshape(blocks, -1, weight.group_size, LANES)
    values = values * weight.scales[:, :, None, :]
    if weight.offsets is not None:
        values = values + weight.offsets[:, :, None, :]
    values = values.reshape(blocks, in_features, LANES).permute(1, 0, 2)
    return values.reshape(in_features, blocks * LANES)[:, :weight.out_features]


def dequantize_linear(x: torch.Tensor, weight: PackedWeight,
                      bias: torch.Tensor | None) -> torch.Tensor:
    out = _rows(x) @ dequantized_transposed(weight)
    return out + bias if bias is not None else out


def a8_or_native_linear(x: torch.Tensor, weight: PackedWeight,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """int8 activations where the weight's widths allow (multiples of 32), else float32."""
    if a8_fits(weight):
        return a8_linear(x, weight, bias)
    return native_linear(x, weight, bias)


_KERNEL_FUNCTIONS = {"native": native_linear, "dequantize": dequantize_linear,
                     "a8": a8_or_native_linear}


class KernelTable:
    """Which kernel serves a product of n rows (one choice per row class)."""

    def __init__(self, choices: dict[int, str]) -> None:
        unknown = set(choices.values()) - set(_KERNEL_FUNCTIONS)
        if unknown or set(choices) != set(ROW_CLASSES):
            raise ValueError(f"a kernel table maps {ROW_CLASSES} to "
                             f"{tuple(_KERNEL_FUNCTIONS)}, got {choices}")
        self.choices = dict(sorted(choices.items()))
        kernels = set(self.choices.values())
        # One kernel for every class: no per-call lookup.
        self._only = _KERNEL_FUNCTIONS[kernels.pop()] if len(kernels) == 1 else None

    @classmethod
    def uniform(cls, kernel: str) -> KernelTable:
        return cls(dict.fromkeys(ROW_CLASSES, kernel))

    def kernel_for(self, rows: int) -> str:
        for bound, kernel in self.choices.items():
            if rows <= bound:
                return kernel
        return self.choices[ROW_CLASSES[-1]]

    def linear(self, x: torch.Tensor, weight: PackedWeight,
               bias: torch.Tensor | None) -> torch.Tensor:
        if self._only is not None:
            out = self._only(x, weight, bias)
        else:
            rows = x.numel() // x.shape[-1]
            out = _KERNEL_FUNCTIONS[self.kernel_for(rows)](x, weight, bias)
        # (The kernels return [rows, out]: already the shape of a 2-D input's product.)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.out_features)


def sample_weight(bits: int, out_features: int = 2048, in_features: int = 1024,
                  group_size: int = 128) -> PackedWeight:
    """A seeded random weight in a decoder's proportions, quantized and packed."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.02
    quantized: QuantizedWeight = (quantize_int8(weight) if bits == 8
                                  else quantize_int4_rtn(weight, group_size))
    return pack(quantized)


@torch.inference_mode()
def measure_kernel_table(bits: int) -> KernelTable:
    """Time both kernels at each row class's bound; the faster serves the class."""
    weight = sample_weight(bits)
    generator = torch.Generator().manual_seed(1)
    choices = {}
    for rows in ROW_CLASSES:
        x = torch.randn(rows, weight.in_features, generator=generator)
        times = {kernel: median_seconds(
                     lambda k=kernel, x=x: _KERNEL_FUNCTIONS[k](x, weight, None))
                 for kernel in KERNELS}
        choices[rows] = min(times, key=times.get)
    return KernelTable(choices)


def kernel_table(bits: int, threads: int | None = None,
                 activations: str = "float32") -> KernelTable:
    """The measured table for this machine, from the cache when it was measured before;
    with int8 activations, the VNNI kernel for every row count where the CPU has it."""
    if activations == "int8":
        if a8_library() is not None:
            return KernelTable.uniform("a8")
        logger.warning("quantization_activations int8: this CPU (or compiler) has no "
                       "AVX-512 VNNI + VBMI kernels; activations stay float32")
    if native_library() is None:
        return KernelTable.uniform("dequantize")
    threads = threads or torch.get_num_threads()
    path = CACHE / "kernels" / f"table-{build_key(SOURCE)}-int{bits}-{threads}t.json"
    if path.is_file():
        return KernelTable({int(k): v for k, v in json.loads(path.read_text()).items()})
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        table = measure_kernel_table(bits)
    finally:
        torch.set_num_threads(before)
    path.write_text(json.dumps(table.choices))
    logger.info("int%d kernels measured for rows %s: %s", bits, ROW_CLASSES,
                list(table.choices.values()))
    return table
