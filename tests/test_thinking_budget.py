"""The thinking budget on the engine's logits-processor pipeline, with a tiny random
model whose tokenizer has `<think>` / `</think>`: the end marker comes exactly at the
budget, nothing else changes, and speculation, prefix caching and streaming agree."""

from __future__ import annotations

import pytest

from tests.engine_run import run_staggered
from tokenmill import SamplingParams
from tokenmill.engine.engine import LLMEngine

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9], [11, 12, 13] * 6, list(range(40, 57))]
MAX_TOKENS = 24


def make_engine(model_dir, **options) -> LLMEngine:
    options.setdefault("block_size", 8)
    return LLMEngine.from_kwargs(str(model_dir), progress=False, **options)


@pytest.fixture(scope="module")
def engine(thinking_model_dir) -> LLMEngine:
    return make_engine(thinking_model_dir)


@pytest.fixture(scope="module")
def markers(engine) -> tuple[int, int]:
    thinking = engine.inputs.thinking_tokens([1], SamplingParams())
    assert len(thinking.start_ids) == len(thinking.end_ids) == 1
    return thinking.start_ids[0], thinking.end_ids[0]


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **fields)


def generate(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    engine.add_request("r", prompt, params)
    return engine.run_to_completion()["r"].outputs[0]


@pytest.mark.parametrize("budget", [0, 1, 6, 13])
def test_budget_forces_the_end_marker_exactly_at_the_budget(engine, markers, budget):
    start, end = markers
    for prompt in PROMPTS:
        opened = prompt + [start]  # a template that opens the thinking in the prompt
        plain = generate(engine, opened, greedy()).token_ids
        assert end not in plain[:budget], "pick a budget before the model's own end marker"
        out = generate(engine, opened, greedy(thinking_budget=budget))
        assert out.token_ids[:budget] == plain[:budget]
        assert out.token_ids[budget] == end
        assert out.metrics.num_thinking_tokens == budget
        assert out.reasoning_content == engine.tokenizer.decode(plain[:budget]).lstrip()
        assert "</think>" not in out.content and out.text.count("</think>") >= 1
        assert out.text.endswith(out.content)


def test_budget_counts_from_the_start_marker_the_model_writes(engine, markers):
    start, end = markers
    # logit_bias makes the model open its thinking itself at its first token.
    out = generate(engine, PROMPTS[0], greedy(thinking_budget=4, logit_bias={start: 100.0}))
    assert out.token_ids[0] == start and out.token_ids[5] == end
    assert out.metrics.num_thinking_tokens == 4


def test_bridge_text_is_forced_before_the_end_marker_within_the_budget(engine, markers):
    start, end = markers
    bridge = engine.encode("print(")
    assert len(bridge) >= 2
    out = generate(engine, PROMPTS[1] + [start], greedy(thinking_budget=9, thinking_bridge="print("))
    assert out.token_ids[9 - len(bridge):10] == bridge + [end]
    assert out.metrics.num_thinking_tokens == 9
    # A bridge longer than the budget is dropped: the end marker alone, at the budget.
    out = generate(engine, PROMPTS[1] + [start], greedy(thinking_budget=1, thinking_bridge="print("))
    assert out.token_ids[1] == end


def test_min_thinking_holds_the_end_marker_back(engine, markers):
    start, end = markers
    pushed = {end: 100.0}  # the model would end its thinking at once
    assert generate(engine, PROMPTS[0] + [start], greedy(logit_bias=pushed)).token_ids[0] == end
    out = generate(engine, PROMPTS[0] + [start], greedy(logit_bias=pushed, min_thinking=5))
    assert end not in out.token_ids[:5] and out.token_ids[5] == end


def test_requests_without_a_budget_are_unchanged_token_for_token(engine, markers, llama_dir,
                                                                  thinking_model_dir):
    start, _ = markers
    prompts = [p + [start] for p in PROMPTS] + PROMPTS
    with_parser = run_staggered(engine, prompts, greedy())
    # The same weights with a tokenizer that has no markers: the pre-reasoning path.
    assert run_staggered(make_engine(llama_dir), prompts, greedy()) == with_parser
    unparsed = make_engine(thinking_model_dir, reasoning_parser="none")
    assert run_staggered(unparsed, prompts, greedy()) == with_parser
    # A budget the output can never reach changes nothing either.
    assert run_staggered(engine, prompts, greedy(thinking_budget=MAX_TOKENS)) == with_parser


SPECULATION = {
    "draft_self": lambda model_dir: {"speculative_method": "draft",
                                     "speculative_model": str(model_dir)},
    "ngram": lambda model_dir: {"speculative_method": "ngram", "prompt_lookup_min": 1},
}


@pytest.mark.parametrize("method", sorted(SPECULATION))
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_budget_with_speculation_is_token_identical(engine, markers, thinking_model_dir,
                                                    method, sampling):
    start, _ = markers
    prompts = [p + [start] for p in PROMPTS]
    params = [greedy(thinking_budget=b) for b in (2, 7, 11)]
    if sampling == "seeded":
        params = [SamplingParams(temperature=1.0, seed=3 + i, max_tokens=MAX_TOKENS,
                                 ignore_eos=True, thinking_budget=p.thinking_budget)
                  for i, p in enumerate(params)]
    reference = run_staggered(engine, prompts, params, arrivals=[0, 2, 5])
    speculative = make_engine(thinking_model_dir, spec_adaptive=False,
                              **SPECULATION[method](thinking_model_dir))
    assert run_staggered(speculative, prompts, params, arrivals=[0, 2, 5]) == reference
    assert speculative.stats.spec_draft_tokens > 0


def test_budget_with_prefix_caching_matches_without(engine, markers, thinking_model_dir):
    start, _ = markers
    prompt = PROMPTS[2] * 2 + [start]
    params = greedy(thinking_budget=5)
    uncached = run_staggered(make_engine(thinking_model_dir, enable_prefix_caching=False),
                             [prompt, prompt], params, arrivals=[0, 30])
    hits_before = engine.kv_manager.prefix_hits
    assert run_staggered(engine, [prompt, prompt], params, arrivals=[0, 30]) == uncached
    assert engine.kv_manager.prefix_hits > hits_before  # the second request hit the cache


def test_streamed_outputs_grow_into_the_final_split(engine, markers):
    start, _ = markers
    params = SamplingParams(temperature=1.0, seed=0, n=2, max_tokens=MAX_TOKENS,
                            ignore_eos=True, thinking_budget=6)
    engine.add_request("s", PROMPTS[0] + [start], params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o for o in engine.step() if o.request_id == "s"]
    final = seen[-1]
    assert final.finished
    for output in seen:
        for partial, done in zip(output.outputs, final.outputs, strict=True):
            assert done.reasoning_content.startswith(partial.reasoning_content or "")
            assert done.content.startswith(partial.content)
    assert all(c.metrics.num_thinking_tokens == 6 for c in final.outputs)


def test_thinking_fields_on_a_model_that_does_not_reason_are_a_value_error(llama_dir):
    plain = make_engine(llama_dir)
    assert plain.reasoning is None
    for fields, name in (({"thinking_budget": 4}, "thinking_budget"),
                         ({"min_thinking": 2}, "min_thinking")):
        with pytest.raises(ValueError, match=f"^{name}: this model does not reason"):
            plain.add_request("x", PROMPTS[0], greedy(**fields))
    out = generate(plain, PROMPTS[0], greedy())
    assert out.reasoning_content is None and out.content == out.text
