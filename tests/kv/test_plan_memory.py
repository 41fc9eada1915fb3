"""Budget -> blocks arithmetic with a quantized KV cache, and `tokenmill plan memory`."""

from __future__ import annotations

import pytest
import torch

from tokenmill.cli import main
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.layers.cpu_blas import onednn_available
from tokenmill.model.arch import ArchConfig
from tokenmill.model.loader import read_config
from tokenmill.worker.memory import (
    kv_bytes_per_block,
    plan_deployment_memory,
    plan_kv_blocks,
    plan_memory,
)

CPU = torch.device("cpu")


@pytest.fixture
def arch() -> ArchConfig:
    # Qwen2.5-0.5B's shape: 24 layers, 2 KV heads of 64 dims, tied embeddings.
    return ArchConfig.from_hf_config(dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936,
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True))


def test_kv_cache_dtype_is_validated():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")


def test_block_bytes_include_one_float32_scale_per_token_head(arch):
    fp32 = kv_bytes_per_block(arch, 16, torch.float32)
    assert fp32 == 2 * 24 * 16 * 2 * 64 * 4
    for kv_dtype in ("int8", "fp8"):
        assert kv_bytes_per_block(arch, 16, torch.float32, kv_dtype) == 2 * 24 * 16 * 2 * (64 + 4)
    assert kv_bytes_per_block(arch, 16, torch.bfloat16, "int8") == fp32 * 68 // 256


def test_int8_budget_holds_about_four_times_the_fp32_tokens(arch):
    budget = 512 * 2**20
    plans = {d: plan_kv_blocks(EngineConfig.from_kwargs(kv_cache_memory=budget, kv_cache_dtype=d,
                                                        max_model_len=4096),
                               arch, torch.float32, CPU)
             for d in ("auto", "int8", "fp8")}
    ratio = plans["int8"].num_tokens / plans["auto"].num_tokens
    # 4x minus the scale overhead: 64 * 4 bytes vs 64 + 4 bytes per token per head.
    assert ratio == pytest.approx(256 / 68, rel=0.01)
    assert plans["fp8"].num_blocks == plans["int8"].num_blocks
    assert plans["int8"].max_concurrent_sequences == plans["int8"].num_blocks // 256
    assert all(p.total_bytes <= budget for p in plans.values())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe",
                                    "qwen3_moe"])
def test_parameter_count_matches_the_checkpoint(model_factory, family):
    from tokenmill.model.loader import load_model

    loaded = load_model(model_factory(family), progress=False)
    assert loaded.arch.num_parameters == sum(p.numel() for p in loaded.model.parameters())


def test_plan_memory_adds_weights_kv_and_activations(arch):
    config = EngineConfig.from_kwargs(kv_cache_dtype="int8")
    plan = plan_memory(config, arch, torch.float32, context=8192, concurrency=32,
                       device_memory=16 * 10**9)
    assert plan.num_parameters == pytest.approx(494e6, rel=0.01)
    assert plan.kv.total_bytes == 512 * 32 * kv_bytes_per_block(arch, 16, torch.float32, "int8")
    assert plan.total_bytes == plan.weights_bytes + plan.kv.total_bytes + plan.activation_bytes
    assert plan.fits and plan.max_concurrency >= 32
    tight = plan_memory(config, arch, torch.float32, 8192, 32, device_memory=plan.total_bytes - 1)
    assert not tight.fits and tight.max_concurrency == 31


def test_cli_plan_memory_reports_the_fit(llama_dir, capsys):
    args = ["plan", "memory", "--model", str(llama_dir), "--context", "256",
            "--concurrency", "4", "--kv-cache-dtype", "int8"]
    assert main([*args, "--device-memory", str(10**9)]) == 0
    out = capsys.readouterr().out
    assert "KV int8" in out and "fits: yes" in out
    assert main([*args, "--device-memory", "1000"]) == 1
    assert "fits: NO" in capsys.readouterr().out
    assert read_config(llama_dir).num_layers == 2


@pytest.mark.parametrize("cpu_blas", [
    pytest.param("onednn", marks=pytest.mark.skipif(not onednn_available(),
                                                    reason="torch built without oneDNN")),
    "torch"])
@pytest.mark.parametrize("method", [None, "ngram", "draft", "eagle"])
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_memory_plan_with_speculation_equals_what_start_up_allocates(
        model_factory, eagle_head_dir, method, cpu_blas, quantization):
    """`tokenmill plan memory` (nothing loaded) and the engine's start-up (measured on the
    tensors) count the same bytes: the proposer's weights and KV pool, the tied LM
    head's second copy on the repacking (oneDNN) path, and quantized codes and scales
    (the target's; proposers keep float weights)."""
    # Tied embeddings; the EAGLE head was built for the untied tiny llama.
    target = model_factory("llama" if method == "eagle" else "llama_mqa_tied")
    options = {"model": str(target), "cpu_blas": cpu_blas, "num_blocks": 24, "block_size": 8}
    if quantization != "none":
        options.update(quantization=quantization, quantization_group_size=32)
    if method is not None:
        options["speculative_method"] = method
    if method == "draft":  # a tied draft: its own LM head is kept twice when repacked
        options["speculative_model"] = str(target)
    if method == "eagle":
        options["speculative_model"] = str(eagle_head_dir)
    engine = LLMEngine.from_kwargs(progress=False, **options)
    measured = engine.info.memory
    plan = plan_deployment_memory(EngineConfig.from_kwargs(**options), context=64,
                                  concurrency=3, device_memory=10**9)
    assert plan.weights_bytes == measured.weights + measured.proposer_weights
    assert plan.kv.bytes_per_block == engine.kv_plan.bytes_per_block
    assert plan.kv.bytes_per_block * engine.kv_plan.num_blocks == (
        measured.kv_cache + measured.proposer_kv_cache)
    assert (measured.proposer_weights > 0) == (method in ("draft", "eagle"))
    assert (measured.proposer_kv_cache > 0) == (method in ("draft", "eagle"))
