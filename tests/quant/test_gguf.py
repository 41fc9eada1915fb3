"""GGUF checkpoints: every format loads to what the gguf package itself dequantizes it
to, kept-quantized formats run token-identical to those dequantized weights, the
tokenizer comes from the file's metadata, and the memory plan counts the kept blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.engine_run import run_staggered
from tests.quant.gguf_files import write_gguf
from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.layers.block_tensor import BlockTensor
from tokenmill.layers.linear import Linear
from tokenmill.model.gguf import dequantize_blocks
from tokenmill.quant.formats import dequantize
from tokenmill.quant.gguf_blocks import BlockLinearMethod, decode_blocks
from tokenmill.worker.memory import plan_deployment_memory

PROMPTS = [[5, 17, 42, 99, 3, 8, 1, 2, 3, 4, 5, 6, 7], list(range(20, 61)), [7, 7, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def random_q4_k_blocks(rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """Valid Q4_K bytes (the gguf package cannot write Q4_K): float16 d and dmin of a
    weight's size, then random six-bit scales and nibbles."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, blocks, 144), dtype=np.uint8)
    halves = rng.uniform(1e-4, 2e-3, size=(rows, blocks, 2)).astype(np.float16)
    data[..., 0:4] = halves.view(np.uint8).reshape(rows, blocks, 4)
    return data.reshape(rows, blocks * 144)


def block_tensor(format: str, rows: int = 24, columns: int = 512) -> BlockTensor:
    if format == "Q4_K":
        data = random_q4_k_blocks(rows, columns // 256)
    else:
        weight = np.random.default_rng(1).standard_normal((rows, columns)).astype(np.float32)
        data = gguf.quants.quantize(weight, gguf.GGMLQuantizationType[format])
    return BlockTensor(format, torch.from_numpy(data), (rows, columns), dequantize_blocks)


@pytest.mark.parametrize("format", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_decoded_blocks_equal_the_gguf_package_dequantization(format):
    tensor = block_tensor(format)
    expected = tensor.dequantize()
    decoded = decode_blocks(tensor)
    assert decoded.group_size == 32 and decoded.codes.shape == (24, 512)
    torch.testing.assert_close(dequantize(decoded), expected, rtol=1e-6, atol=1e-7)
    # A permuted row order (Q/K un-permutation) decodes to the permuted rows.
    order = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(dequantize(decode_blocks(tensor.rows(order))), expected[order])


@pytest.mark.parametrize("format", ["Q8_0", "Q4_K"])
def test_a_kept_block_layer_multiplies_like_its_dequantized_weight(format):
    tensor = block_tensor(format, rows=40)
    layer = Linear(512, 40)
    layer.set_method(BlockLinearMethod(format))
    layer.load("weight", tensor)
    layer.method.finalize(layer)
    x = torch.randn(3, 512)
    expected = x.double() @ tensor.dequantize().double().t()
    assert (layer(x).double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def mixed_formats(name: str, array: np.ndarray) -> str:
    """Every format the loader reads, spread over the layers."""
    if name.startswith(("blk.0.attn_q", "blk.0.attn_k", "blk.0.attn_v", "blk.1.ffn_down")):
        return "Q8_0"
    if name.startswith(("blk.1.attn_q", "blk.1.attn_k", "blk.1.attn_v", "blk.0.ffn_gate",
                        "blk.0.ffn_up", "blk.1.ffn_gate_exps")):
        return "Q4_0"
    if name.startswith(("blk.0.ffn_down", "blk.1.ffn_up_exps")):
        return "Q4_1"
    if name.startswith(("blk.1.ffn_gate", "blk.1.ffn_up", "token_embd")):
        return "F16"
    if name.startswith("blk.0.attn_output"):
        return "BF16"
    if name.startswith("blk.1.attn_output"):
        return "Q5_0"  # no kernel: dequantized at load
    return "Q8_0" if "exps" in name else "F32"


@pytest.fixture(scope="module")
def gguf_files(model_factory, tmp_path_factory):
    written = {}

    def make(family: str):
        if family not in written:
            written[family] = write_gguf(model_factory(family),
                                         tmp_path_factory.mktemp(f"gguf-{family}"), mixed_formats)
        return written[family]

    return make


def linear_weights(engine: LLMEngine) -> dict[str, torch.Tensor]:
    model = engine.executor.worker.runner.model
    return {name: m.checkpoint_weight() for name, m in model.named_modules()
            if isinstance(m, Linear)}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mixtral"])
def test_gguf_file_loads_its_dequantized_weights_and_generates_like_them(gguf_files, family):
    path, reference_dir = gguf_files(family)
    options = {"progress": False, "block_size": 8, "max_num_batched_tokens": 24,
               "cpu_blas": "torch"}
    engine = LLMEngine.from_kwargs(str(path), **options)
    reference = LLMEngine.from_kwargs(str(reference_dir), **options)
    loaded, expected = linear_weights(engine), linear_weights(reference)
    assert loaded.keys() == expected.keys()
    for name, weight in expected.items():
        torch.testing.assert_close(loaded[name], weight, rtol=1e-6, atol=1e-7, msg=name)
    kept = {type(m.method).__name__ for m in engine.executor.worker.runner.model.modules()
            if isinstance(m, Linear)}
    assert "BlockLinearMethod" in kept
    assert (run_staggered(engine, PROMPTS, GREEDY, [0, 1, 1])
            == run_staggered(reference, PROMPTS, GREEDY, [0, 1, 1]))


def test_tokenizer_comes_from_the_gguf_metadata_or_a_directory(gguf_files, llama_dir):
    path, _ = gguf_files("llama")
    text = "def add(a, b):\n    return a + b  # Ünïcödé"
    expected = LLMEngine.from_kwargs(str(llama_dir), progress=False).tokenizer.encode(text)
    from_file = LLMEngine.from_kwargs(str(path), progress=False)
    from_dir = LLMEngine.from_kwargs(str(path), tokenizer=str(llama_dir), progress=False)
    assert from_file.tokenizer.encode(text) == expected == from_dir.tokenizer.encode(text)
    assert from_file.tokenizer.decode(expected) == text


@pytest.mark.parametrize("options", [{}, {"quantization": "int8", "cpu_blas": "torch"}])
def test_memory_plan_counts_the_kept_blocks(gguf_files, options):
    """Kept blocks count as their codes; float tensors follow --quantization."""
    path, _ = gguf_files("mixtral")
    config_options = {"model": str(path), "num_blocks": 16, **options}
    engine = LLMEngine.from_kwargs(progress=False, **config_options)
    plan = plan_deployment_memory(EngineConfig.from_kwargs(**config_options), context=64,
                                  concurrency=2, device_memory=10**9)
    assert plan.weights_bytes == engine.info.memory.weights
