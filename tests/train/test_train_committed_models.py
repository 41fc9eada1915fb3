"""The committed default models load with transformers and give finite logits."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.train.conftest import COMMITTED_MODELS, committed_model_dir


@pytest.mark.parametrize("name", COMMITTED_MODELS)
def test_committed_model_loads_and_gives_finite_logits(name):
    model_dir = committed_model_dir(name)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert model.config.max_position_embeddings >= 2048
    inputs = tokenizer("class Stack:\n    def __init__(self):\n", return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs.input_ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    for name_ in ("README.md", "loss_curve.png", "train_log.json", "generation_config.json"):
        assert (model_dir / name_).is_file(), name_


@pytest.mark.parametrize("name", COMMITTED_MODELS[1:])
def test_committed_models_share_one_tokenizer(name):
    reference = committed_model_dir("pycoder") / "tokenizer.json"
    assert (committed_model_dir(name) / "tokenizer.json").read_bytes() == reference.read_bytes()


def test_committed_moe_has_eight_experts_with_top_two_routing():
    config = json.loads((committed_model_dir("pycoder-moe") / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["num_local_experts"] == 8
    assert config["num_experts_per_tok"] == 2


def test_committed_llama_uses_grouped_query_attention():
    config = json.loads((committed_model_dir("pycoder") / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_attention_heads"] > config["num_key_value_heads"]
