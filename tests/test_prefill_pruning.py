"""Prefill pruning (`--prefill-pruning`, LazyLLM-style): keeping every block is the
plain model token for token; a pruned prompt keeps the blocks transformers' own
attention probabilities rank first, and generates what transformers generates when
the layers above the pruning layer cannot see the dropped blocks; requests beside a
pruned one are untouched; the knobs refuse what cannot compose with it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.config import AttentionConfig, CacheConfig, EngineConfig, SpecConfig
from tokenmill.runner.prefill_pruning import kept_blocks

BLOCK = 4
LONG = [(7 * i + 3) % 380 + 2 for i in range(64)]  # 16 blocks
SHORT = [5, 17, 42, 99, 3, 8]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PRUNING = {"block_size": BLOCK, "enable_prefix_caching": False, "prefill_pruning_layer": 1,
           "prefill_pruning_min_tokens": 16}


def generate(model_dir, prompts, **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), progress=False, **options)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)], llm


def test_kept_blocks_are_the_ends_and_the_best_scored():
    mass = torch.tensor([0.0, 0.5, 0.1, 0.3, 0.05, 0.05])
    assert kept_blocks(mass, 0.5) == [0, 1, 5]  # ceil(0.5 x 6) = 3 blocks
    assert kept_blocks(mass, 0.6) == [0, 1, 3, 5]
    assert kept_blocks(mass, 0.01) == [0, 5]
    assert kept_blocks(mass, 1.0) == list(range(6))


def test_keeping_every_block_is_the_plain_model(llama_dir):
    prompts = [LONG, SHORT, LONG[:37]]
    plain, _ = generate(llama_dir, prompts, block_size=BLOCK)
    ours, llm = generate(llama_dir, prompts, prefill_pruning=1.0, **PRUNING)
    assert ours == plain
    assert llm.engine.executor.worker.runner.pruning.prompts == 2  # SHORT is too short


def masked_greedy(model, prompt: list[int], dropped: list[int], layer: int, steps: int
                  ) -> list[int]:
    """transformers' greedy tokens when decoder layers >= layer cannot attend to the
    dropped blocks' positions (layers below see everything)."""
    columns = [p for b in dropped for p in range(b * BLOCK, (b + 1) * BLOCK)]

    def hide(module, args, kwargs):
        mask = kwargs["attention_mask"]
        mask = mask.clone()
        if mask.dtype == torch.bool:
            mask[..., columns] = False
        else:
            mask[..., columns] = torch.finfo(mask.dtype).min
        kwargs["attention_mask"] = mask
        return args, kwargs

    handles = [model.model.layers[i].register_forward_pre_hook(hide, with_kwargs=True)
               for i in range(layer, len(model.model.layers))]
    ids = list(prompt)
    try:
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
            ids.append(int(logits[0, -1].argmax()))
    finally:
        for handle in handles:
            handle.remove()
    return ids[len(prompt):]


@pytest.mark.parametrize("keep", [0.5, 0.25])
def test_a_pruned_prompt_is_transformers_without_the_dropped_blocks(llama_dir, keep):
    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = model(input_ids=torch.tensor([LONG]), output_attentions=True).attentions
        # The last prompt token's attention at the layer below the pruning layer.
        mass = attentions[0][0, :, -1, :].mean(0).view(-1, BLOCK).sum(-1)
        dropped = sorted(set(range(len(LONG) // BLOCK)) - set(kept_blocks(mass, keep)))
        expected = masked_greedy(model, LONG, dropped, 1, GREEDY.max_tokens)
        unmasked = masked_greedy(model, LONG, [], 1, GREEDY.max_tokens)
    assert expected != unmasked  # the drop changes the answer: the test can tell
    ours, llm = generate(llama_dir, [LONG], prefill_pruning=keep, **PRUNING)
    assert ours[0] == expected
    pruning = llm.engine.executor.worker.runner.pruning
    assert pruning.dropped_tokens == len(dropped) * BLOCK and not pruning.dropped


def test_requests_beside_a_pruned_one_are_untouched(llama_dir):
    alone, _ = generate(llama_dir, [SHORT, LONG[:12]], block_size=BLOCK)
    mixed, _ = generate(llama_dir, [SHORT, LONG, LONG[:12]], prefill_pruning=0.25, **PRUNING)
    assert [mixed[0], mixed[2]] == alone


def test_the_knobs_refuse_what_cannot_compose():
    for bad in (0.0, 1.5, True, "half"):
        with pytest.raises(ValueError, match="prefill_pruning"):
            AttentionConfig(prefill_pruning=bad)
    with pytest.raises(ValueError, match="prefill_pruning_layer"):
        AttentionConfig(prefill_pruning_layer=0)
    with pytest.raises(ValueError, match="prefill_pruning_min_tokens"):
        AttentionConfig(prefill_pruning_min_tokens=False)
    with pytest.raises(ValueError, match="sparse_prefill"):
        AttentionConfig(sparse_prefill="yes")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(attention=AttentionConfig(prefill_pruning=0.5))
    with pytest.raises(ValueError, match="prefill_pruning"):
        EngineConfig(attention=AttentionConfig(prefill_pruning=0.5),
                     cache=CacheConfig(enable_prefix_caching=False),
                     spec=SpecConfig(speculative_method="ngram", num_speculative_tokens=2))
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention=AttentionConfig(prefill_pruning=0.5, attention_backend="quest"),
                     cache=CacheConfig(enable_prefix_caching=False))


def test_the_pruning_layer_must_exist(llama_dir):
    with pytest.raises(ValueError, match="prefill_pruning_layer"):
        LLM(str(llama_dir), progress=False, prefill_pruning=0.5,
            **{**PRUNING, "prefill_pruning_layer": 2})


def test_preempted_prompts_are_pruned_afresh_and_nothing_leaks(llama_dir):
    # Two prompts of 16 blocks fill 36 blocks but for 4; growing by 6 each, one is
    # preempted after its prompt was pruned.
    prompts = [LONG, LONG[3:], LONG[5:]]
    llm = LLM(str(llama_dir), progress=False, **PRUNING, prefill_pruning=0.5, num_blocks=36,
              kv_cache_dtype="int8", max_num_batched_tokens=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    engine, pruning = llm.engine, llm.engine.executor.worker.runner.pruning
    assert all(len(t) == params.max_tokens for t in tokens)
    assert engine.scheduler.num_preemptions > 0
    assert pruning.prompts > len(prompts)  # a recomputed prompt is pruned again
    assert not pruning.dropped
    engine.executor.check_integrity(idle=True)
