"""Kernel candidates for quantized products, per row count, on a decoder's weights.

One "pass" multiplies x [rows, in] by every Linear weight of the random Qwen2.5-0.5B
shape (24 layers of fused QKV, o_proj, fused gate/up, down_proj, and the LM head):
far more bytes than the caches hold, as in a real decode step. Candidates, interleaved
(A B C ... A B C) in one run after a warm-up, same inputs, same threads:

    fp32 onednn       the engine's float32 path (weights packed for oneDNN at load)
    int8 native       tokenmill/quant's compiled kernel, per-channel scales
    int4 native       the same, group 128 scale + offset
    int8 dequantize   the float32 weight rebuilt per call, then torch's GEMM
    int4 dequantize
    int8 torch-bf16   aten._weight_int8pack_mm (vectorised for bfloat16 activations only:
                      x is cast to bf16 and back around the call)
    int4 torch-bf16   aten._weight_int4pack_mm_for_cpu, group 128, likewise
    int8 native-a8    csrc/qlinear_a8.cpp: activations rounded to int8 per 32 columns,
    int4 native-a8    AVX-512 VNNI dot products (only where the CPU has them)

For each: median ms per pass, the weight bytes streamed per second, the ratio to fp32
and the largest error against the product with the dequantized float32 weight (the
bf16 activations' rounding shows there). The dequantize candidates run only from
--dequantize-from rows up (at one row they rebuild every weight per token).

    python benchmarks/bench_quant_kernels.py [--threads 2] [--layers 24] [--rows 1,8,32,512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from tokenmill.layers.cpu_blas import onednn_linear, onednn_weight
from tokenmill.quant import kernels
from tokenmill.quant.formats import dequantize, quantize_int4_rtn, quantize_int8
from tokenmill.quant.packing import pack

HIDDEN, INTERMEDIATE, VOCAB = 896, 4864, 151936
LAYER_SHAPES = [(1152, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN),
                (HIDDEN, INTERMEDIATE)]


def candidate_forms(weight: torch.Tensor) -> dict:
    """Each candidate's stored form of one weight, and its product function."""
    q8, q4 = quantize_int8(weight), quantize_int4_rtn(weight, 128)
    p8, p4 = pack(q8), pack(q4)
    scales8 = q8.scales[:, 0].to(torch.bfloat16)
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.codes.int(), 1)
    # torch's int4 CPU kernel computes (code - 8) * scale + zero.
    scale_zero = torch.stack((q4.scales, q4.offsets + 8 * q4.scales), dim=-1)
    scale_zero = scale_zero.transpose(0, 1).contiguous().to(torch.bfloat16)
    onednn = onednn_weight(weight, transposed=False)

    def bf16(fn):
        return lambda x: fn(x.to(torch.bfloat16)).float()

    a8 = {}
    if kernels.a8_library() is not None:
        a8 = {"int8 native-a8": (lambda x: kernels.a8_linear(x, p8, None), dequantize(q8)),
              "int4 native-a8": (lambda x: kernels.a8_linear(x, p4, None), dequantize(q4))}
    return {
        "fp32 onednn": (lambda x: onednn_linear(x, onednn), None),
        "int8 native": (lambda x: kernels.native_linear(x, p8, None), dequantize(q8)),
        "int4 native": (lambda x: kernels.native_linear(x, p4, None), dequantize(q4)),
        "int8 dequantize": (lambda x: kernels.dequantize_linear(x, p8, None), dequantize(q8)),
        "int4 dequantize": (lambda x: kernels.dequantize_linear(x, p4, None), dequantize(q4)),
        "int8 torch-bf16": (bf16(lambda x: torch.ops.aten._weight_int8pack_mm(
            x, q8.codes, scales8)), dequantize(q8)),
        "int4 torch-bf16": (bf16(lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, packed4, 128, scale_zero)), dequantize(q4)),
    } | a8


BYTES_PER_WEIGHT = {"fp32": 4.0, "int8": 1.0, "int4": 0.5 + 8 / 128}


def build(layers: int, lm_head: bool, seed: int = 0) -> tuple[list, list]:
    generator = torch.Generator().manual_seed(seed)
    shapes = LAYER_SHAPES * layers + ([(VOCAB, HIDDEN)] if lm_head else [])
    forms = []
    for shape in shapes:
        weight = 0.02 * torch.randn(*shape, generator=generator)
        forms.append(candidate_forms(weight))
    return shapes, forms


def run_pass(forms: list, inputs: dict, name: str) -> float:
    start = time.perf_counter()
    for form in forms:
        fn, _ = form[name]
        fn(inputs[id(form)])
    return time.perf_counter() - start


def max_error(form: dict, name: str, x: torch.Tensor) -> float:
    fn, reference_weight = form[name]
    if reference_weight is None:
        return 0.0
    expected = x.double() @ reference_weight.double().t()
    return ((fn(x).double() - expected).abs().max() / expected.abs().max()).item()


def measure(shapes, forms, rows: int, names: list[str], repeats: int) -> dict[str, dict]:
    generator = torch.Generator().manual_seed(rows)
    inputs = {id(form): torch.randn(rows, shape[1], generator=generator)
              for shape, form in zip(shapes, forms, strict=True)}
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        run_pass(forms, inputs, name)  # warm-up: kernel builds, oneDNN JIT
    for _ in range(repeats):
        for name in names:  # interleaved
            times[name].append(run_pass(forms, inputs, name))
    weights = sum(n * k for n, k in shapes)
    first = forms[0]
    return {name: {"ms": 1000 * statistics.median(times[name]),
                   "gbs": weights * BYTES_PER_WEIGHT[name.split()[0]]
                   / statistics.median(times[name]) / 1e9,
                   "error": max_error(first, name, inputs[id(first)])}
            for name in names}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--no-lm-head", action="store_true")
    parser.add_argument("--rows", default="1,8,32,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dequantize-from", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if kernels.native_library() is None:
        print("the native kernels could not be compiled: nothing to compare")
        return 1
    with torch.inference_mode():
        shapes, forms = build(args.layers, not args.no_lm_head)
        print(f"{len(shapes)} weights, {sum(n * k for n, k in shapes) / 1e6:.0f}M parameters, "
              f"{args.threads} threads, median of {args.repeats} interleaved passes")
        print("| rows | candidate | ms/pass | weight GB/s | vs fp32 | max rel. error |")
        print("| --- | --- | --- | --- | --- | --- |")
        for rows in (int(r) for r in args.rows.split(",")):
            names = [n for n in forms[0]
                     if "dequantize" not in n or rows >= args.dequantize_from]
            results = measure(shapes, forms, rows, names, args.repeats)
            base = results["fp32 onednn"]["ms"]
            for name, r in results.items():
                print(f"| {rows} | {name} | {r['ms']:.2f} | {r['gbs']:.1f} | "
                      f"{base / r['ms']:.2f}x | {r['error']:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
