"""Quantized weights in the memory plan: `tokenmill plan memory --quantization ...`
counts the bytes start-up measures, and what the weights save goes to the KV cache."""

from __future__ import annotations

import pytest
import torch

from tests.models import TOKENIZER_CORPUS
from tokenmill.cli import main
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.layers.products import ProductPolicy
from tokenmill.model.arch import ArchConfig
from tokenmill.quant.policy import quantized_products
from tokenmill.worker.memory import plan_deployment_memory, plan_memory, planned_weight_bytes

CPU = torch.device("cpu")


@pytest.mark.parametrize("family", ["llama", "llama_mqa_tied", "mixtral"])
@pytest.mark.parametrize("options", [
    {"quantization": "int8"},
    {"quantization": "int8", "quantization_group_size": 32, "quantization_exclude": "lm_head"},
    {"quantization": "int4", "quantization_group_size": 64, "cpu_blas": "torch"},
    {"quantization": "int4", "quantization_group_size": 32,
     "quantization_exclude": "lm_head,*.layers.1.*"},
    {"quantization": "int4", "quantization_group_size": 32, "quantization_method": "awq"},
])
def test_plan_counts_the_quantized_bytes_start_up_measures(model_factory, family, options,
                                                           tmp_path):
    if options.get("quantization_method") == "awq":  # plus one scale per input column
        (tmp_path / "calibration.txt").write_text("".join(TOKENIZER_CORPUS) * 4)
        options = {**options, "quantization_calibration": str(tmp_path / "calibration.txt")}
    config_options = {"model": str(model_factory(family)), "num_blocks": 16, **options}
    engine = LLMEngine.from_kwargs(progress=False, **config_options)
    plan = plan_deployment_memory(EngineConfig.from_kwargs(**config_options), context=64,
                                  concurrency=2, device_memory=10**9)
    assert plan.weights_bytes == engine.info.memory.weights
    assert options["quantization"] in plan.products


def test_quantized_weights_leave_room_for_more_sequences():
    # Qwen2.5-0.5B's shape: the tied LM head is a quarter of the parameters.
    arch = ArchConfig.from_hf_config(dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936,
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True))
    plans = {}
    for quantization in ("none", "int8", "int4"):
        config = EngineConfig.from_kwargs(quantization=quantization)
        policy = quantized_products(config.quant, ProductPolicy(CPU), torch.float32)
        plans[quantization] = plan_memory(config, arch, torch.float32, 4096, 4, 3 * 10**9,
                                          policy=policy)
    fp32 = plans["none"].weights_bytes
    assert fp32 == planned_weight_bytes(arch, torch.float32, ProductPolicy(CPU))
    # int8: a quarter of the bytes and a float32 scale per row; int4 (group 128): an
    # eighth and 0.5 bit per weight of scales and offsets.
    assert plans["int8"].weights_bytes == pytest.approx(fp32 / 4, rel=0.01)
    assert plans["int4"].weights_bytes == pytest.approx(fp32 * 4.5 / 32, rel=0.01)
    concurrency = [plans[q].max_concurrency for q in ("none", "int8", "int4")]
    assert concurrency[0] < concurrency[1] < concurrency[2]
    assert plans["none"].kv.bytes_per_block == plans["int4"].kv.bytes_per_block


def test_cli_plan_memory_takes_the_quantization_flags(llama_dir, capsys):
    args = ["plan", "memory", "--model", str(llama_dir), "--context", "256",
            "--concurrency", "4", "--device-memory", str(10**9)]
    assert main([*args, "--quantization", "int4", "--quantization-group-size", "32"]) == 0
    assert "int4-rtn-g32" in capsys.readouterr().out
    assert main([*args, "--quantization", "int8", "--quantization-method", "hqq"]) == 2
    assert "quantization_method" in capsys.readouterr().err
