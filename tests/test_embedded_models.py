"""The committed models load in transformers and tokenmill and agree on greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill import LLM, SamplingParams

MODELS = Path(__file__).resolve().parent.parent / "models"
PROMPTS = ["def fibonacci(n):\n", "import os\n\ndef ", "class Stack:\n    def __init__(self):\n"]
NEW_TOKENS = 24


@pytest.mark.parametrize("name", ["pycoder", "pycoder-draft", "pycoder-moe"])
def test_committed_model_matches_transformers_greedy(name):
    model_dir = MODELS / name
    assert (model_dir / "config.json").is_file(), f"{model_dir} is missing"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), progress=False)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        assert out.prompt_token_ids == ids[0].tolist()
        reference = hf.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)[0, ids.shape[1]:]
        ours = out.outputs[0].token_ids
        assert ours == reference[:len(ours)].tolist()
        assert len(ours) == NEW_TOKENS or out.outputs[0].finish_reason == "stop"


def test_default_model_is_pycoder():
    from tokenmill.config import DEFAULT_MODEL_DIR

    assert DEFAULT_MODEL_DIR == MODELS / "pycoder"
