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


PYREASON = MODELS / "pyreason"


@pytest.fixture(scope="module")
def pyreason() -> LLM:
    if not (PYREASON / "model.safetensors").is_file():
        pytest.skip("models/pyreason is not trained yet")
    return LLM(str(PYREASON), progress=False, max_num_seqs=64)


def test_pyreason_matches_transformers_greedy(pyreason):
    from tokenmill.train.reasoning_eval import eval_items

    tokenizer = AutoTokenizer.from_pretrained(PYREASON)
    hf = AutoModelForCausalLM.from_pretrained(PYREASON, dtype=torch.float32).eval()
    for item in eval_items(1)[::2]:
        ids = pyreason.apply_chat_template([{"role": "user", "content": item.program}])
        assert ids == tokenizer.apply_chat_template(
            [{"role": "user", "content": item.program}], add_generation_prompt=True,
            tokenize=True, return_dict=False)
        ours = pyreason.generate([ids], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
        reference = hf.generate(torch.tensor([ids]), do_sample=False,
                                max_new_tokens=NEW_TOKENS)[0, len(ids):].tolist()
        assert ours[0].outputs[0].token_ids == reference[:len(ours[0].outputs[0].token_ids)]


def test_pyreason_reasons_and_a_budget_ends_its_thinking_at_the_budget(pyreason):
    from tokenmill.train.reasoning_eval import eval_items, greedy_params, score, summarize

    items = eval_items(8)
    free = {row.level: row for row in summarize(score(pyreason, items, greedy_params()))}
    assert free[1].accuracy >= 0.75 and free[None].accuracy >= 0.5
    assert free[6].mean_thinking > 2 * free[1].mean_thinking
    starved = {row.level: row for row in summarize(
        score(pyreason, items, greedy_params(thinking_budget=0)))}
    assert starved[None].mean_thinking == 0
    # Without thinking the model guesses: the hard levels lose most of their accuracy.
    hard = (4, 5, 6)
    assert sum(starved[h].accuracy for h in hard) < sum(free[h].accuracy for h in hard) - 0.5
    start_id, end = pyreason.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    prompts = [pyreason.apply_chat_template([{"role": "user", "content": i.program}])
               for i in items if i.level >= 3]
    for output in pyreason.generate(prompts, greedy_params(thinking_budget=10)):
        completion = output.outputs[0]
        start = completion.token_ids.index(start_id)
        assert completion.token_ids[start + 11] == end
        assert completion.metrics.num_thinking_tokens == 10
        # The thinking is closed once: cut short, this model would go on thinking in its
        # answer and close it again; the budget keeps the marker out of the answer.
        assert completion.token_ids.count(end) == 1
        assert "</think>" not in completion.content


def test_pycoder_long_matches_transformers_past_pycoders_context():
    """pycoder-long (RoPE base 160000) agrees with transformers at 5000 tokens of
    context, beyond pycoder's 2048, and its committed calibration fits it."""
    from tokenmill.attention.sparse_calibration import FILENAME, SparseCalibration
    from tokenmill.train.corpus import held_out_texts

    model_dir = MODELS / "pycoder-long"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("\n".join(held_out_texts()[:40]))["input_ids"][:5000]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8,
                            pad_token_id=0)[0, len(ids):].tolist()
    llm = LLM(str(model_dir), progress=False)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out[0].outputs[0].token_ids == reference
    assert llm.engine.max_model_len == 8192
    SparseCalibration.load(model_dir / FILENAME).check(6, 2, 32)
