"""The length-penalised SFT objective (tokenmill/train/sft.py) on hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

from tokenmill.train.reasoning_data import build_reasoning_tokenizer
from tokenmill.train.sft import (
    Completion,
    batch_tensors,
    length_penalized_loss,
    prompt_groups,
    tilted_weights,
)

PAIR = (Completion("long", 0.75, 30), Completion("short", 0.25, 10))


def test_weights_tilt_the_data_distribution_towards_short_thinking():
    assert tilted_weights(PAIR, 0.0) == pytest.approx([0.75, 0.25])
    tilt = 0.75 * math.exp(-0.05 * 20)  # the long one pays 20 more tokens
    assert tilted_weights(PAIR, 0.05) == pytest.approx([tilt / (tilt + 0.25),
                                                        0.25 / (tilt + 0.25)])
    assert tilted_weights(PAIR, 0.05)[0] == pytest.approx(0.52464, abs=1e-5)
    assert tilted_weights(PAIR, 5.0)[1] > 0.999
    with pytest.raises(ValueError, match="length_penalty"):
        tilted_weights(PAIR, -0.1)


def test_loss_is_the_weighted_token_mean_over_completion_tokens():
    input_ids = torch.tensor([[0, 1, 1], [0, 0, 1]])
    mask = torch.tensor([[0, 1, 1], [0, 0, 1]])  # sequence 1's first target is prompt
    logits = torch.zeros(2, 3, 2)
    logits[0, 0, 1] = math.log(3)  # p(1) = 3/4 where token 1 follows
    logits[1, 1, 0] = math.log(3)  # p(1) = 1/4 where token 1 follows
    weights = torch.tensor([0.25, 0.75])
    ce_first = [math.log(4 / 3), math.log(2)]  # sequence 0, both targets counted
    ce_second = math.log(4)  # sequence 1, its one completion target
    expected = (0.25 * sum(ce_first) + 0.75 * ce_second) / (0.25 * 2 + 0.75 * 1)
    assert float(length_penalized_loss(logits, input_ids, mask, weights)) == pytest.approx(
        expected, rel=1e-6)
    # Equal weights: the plain mean cross-entropy over completion tokens.
    plain = (sum(ce_first) + ce_second) / 3
    assert float(length_penalized_loss(logits, input_ids, mask, torch.ones(2))) == pytest.approx(
        plain, rel=1e-6)


def test_batches_pair_each_program_with_both_traces_and_mask_the_prompt(tmp_path):
    build_reasoning_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    groups = prompt_groups(seed=3, count=4, tokenizer=tokenizer)
    for group in groups:
        verbose, terse = group.completions
        assert verbose.text.split("</think>")[1] == terse.text.split("</think>")[1]
        assert verbose.thinking_tokens > terse.thinking_tokens
    input_ids, mask, weights = batch_tensors(tokenizer, groups, alpha=0.05, pad_id=0)
    assert input_ids.shape[0] == 8 and weights.view(4, 2).sum(dim=1).allclose(torch.ones(4))
    assert weights[0] == pytest.approx(tilted_weights(groups[0].completions, 0.05)[0])
    prompt_len = len(tokenizer(groups[0].prompt, add_special_tokens=False)["input_ids"])
    assert mask[0, :prompt_len].sum() == 0 and mask[0, prompt_len] == 1
    assert tokenizer.decode(input_ids[0, prompt_len:prompt_len + 1]) == "<think>"
