"""tokenmill vs transformers on the same weights: greedy tokens and logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.models import FAMILIES
from tokenmill import LLM, SamplingParams
from tokenmill.layers import native_linear
from tokenmill.layers.cpu_blas import onednn_available

PROMPTS = [[5, 17, 42, 99, 3], list(range(20, 61)), [7, 7, 7], [300, 12]]
NEW_TOKENS = 32


@pytest.mark.parametrize("cpu_blas", [
    pytest.param("onednn", marks=pytest.mark.skipif(not onednn_available(),
                                                    reason="torch built without oneDNN")),
    "numpy", "torch",
    pytest.param("native", marks=pytest.mark.skipif(not native_linear.available(),
                                                     reason="no C++ compiler"))])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_and_logprobs_match_transformers(family, cpu_blas, model_factory):
    check_against_transformers(model_factory(family), cpu_blas=cpu_blas)


# Every attention backend beside `paged` (which the test above runs).
@pytest.mark.parametrize("attention_backend", ["paged-native"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_attention_backends_match_transformers(family, attention_backend, model_factory):
    check_against_transformers(model_factory(family), attention_backend=attention_backend)


def check_against_transformers(model_dir, **options) -> None:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), progress=False, **options)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                            logprobs=5, prompt_logprobs=1)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        reference = hf.generate(torch.tensor([prompt]), do_sample=False,
                                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert out.outputs[0].token_ids == reference[0, len(prompt):].tolist()
        with torch.no_grad():
            logprobs = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        # Every prompt position's prediction of the next prompt token.
        ours = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
        theirs = logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
        # The last position's distribution: the top-5 alternatives of the first token.
        first = out.outputs[0].logprobs[0]
        top_values, top_ids = logprobs[-1].topk(5)
        assert [t for t, _ in first.top] == top_ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in first.top]), top_values,
                                   atol=1e-4, rtol=1e-4)
