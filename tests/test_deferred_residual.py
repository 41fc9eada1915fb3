"""The decoder's deferred residual add (each layer's MLP output added by the next
layer's input norm, the last one's by the final norm, in one compiled call) changes no
bit: logprobs equal those of layers that add their MLP output themselves."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.model import llama

PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2,
                        ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3], list(range(20, 61))]


def logprobs(llm: LLM) -> list[list[tuple[int, float]]]:
    result = []
    for output in llm.generate(PROMPTS, PARAMS):
        steps = [*output.prompt_logprobs[1:], *output.outputs[0].logprobs]
        result.append([(step.token_id, step.logprob, *step.top) for step in steps])
    return result


@pytest.mark.parametrize("cpu_blas", ["native", "torch"])
def test_deferred_residual_add_changes_no_bit(monkeypatch, llama_dir, cpu_blas):
    deferred = logprobs(LLM(str(llama_dir), progress=False, cpu_blas=cpu_blas))
    real = llama.DecoderLayer.forward
    calls = []

    def adding_itself(self, rope, hidden, attention, pending=None, defer=False):
        calls.append(pending is not None)
        if pending is not None:  # the previous layer's add, as torch runs it
            hidden = hidden + pending
        out = real(self, rope, hidden, attention)
        return (out, torch.zeros_like(out)) if defer else out

    monkeypatch.setattr(llama.DecoderLayer, "forward", adding_itself)
    assert logprobs(LLM(str(llama_dir), progress=False, cpu_blas=cpu_blas)) == deferred
    assert any(calls)  # the model's loop hands each layer the last one's output
