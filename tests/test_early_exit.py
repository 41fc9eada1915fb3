"""Early exit: threshold 1 is the plain model token for token; an exit for every token
is the model cut at the exit layer (transformers with those layers is the oracle);
partial exits do not depend on what else is in the batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 99, 3], list(range(20, 61)), [7, 7, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PYREASON = Path(__file__).resolve().parent.parent / "models" / "pyreason"


def tokens(model_dir, prompts=PROMPTS, **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), progress=False, **options)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)], llm


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_threshold_one_never_exits(model_factory, family):
    model_dir = model_factory(family)
    plain, _ = tokens(model_dir)
    exits, llm = tokens(model_dir, early_exit_layer=1, early_exit_threshold=1.0)
    assert exits == plain
    counts = llm.engine.executor.worker.runner.early_exit
    assert counts.tokens > 0 and counts.exited == 0


def test_every_token_exiting_is_the_model_cut_at_the_exit_layer(model_factory):
    model_dir = model_factory("qwen3")
    ours, llm = tokens(model_dir, early_exit_layer=1, early_exit_threshold=0.0)
    assert llm.engine.executor.worker.runner.early_exit.whole_steps > 0
    config = AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers = 1
    cut = AutoModelForCausalLM.from_pretrained(model_dir, config=config,
                                               dtype=torch.float32).eval()
    full, _ = tokens(model_dir)
    for prompt, generated, plain in zip(PROMPTS, ours, full, strict=True):
        # The prompt runs every layer (prefill is not eligible): the first token is the
        # full model's; every later one is decoded through layer 1 only.
        assert generated[0] == plain[0]
        reference = cut.generate(torch.tensor([prompt + generated[:1]]), do_sample=False,
                                 max_new_tokens=len(generated) - 1)[0, len(prompt) + 1:]
        assert generated[1:] == reference.tolist()


def test_partial_exits_do_not_depend_on_the_batch():
    from tokenmill.train.reasoning_eval import eval_items

    llm = LLM(str(PYREASON), progress=False, early_exit_layer=3, early_exit_threshold=0.9)
    prompts = [llm.apply_chat_template([{"role": "user", "content": item.program}])
               for item in eval_items(1)]
    params = SamplingParams(temperature=0, max_tokens=40)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    counts = llm.engine.executor.worker.runner.early_exit
    assert 0 < counts.exited < counts.tokens  # some tokens exit, some do not
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone


def test_bad_exit_settings_are_clear_errors(llama_dir):
    with pytest.raises(ValueError, match="early_exit_layer must be in"):
        LLM(str(llama_dir), progress=False, early_exit_layer=2)
    with pytest.raises(ValueError, match="early_exit_layer"):
        LLM(str(llama_dir), progress=False, early_exit_layer=1, speculative_method="ngram")
    with pytest.raises(ValueError, match="early_exit_threshold"):
        LLM(str(llama_dir), progress=False, early_exit_layer=1, early_exit_threshold=1.5)
