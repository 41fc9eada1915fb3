"""Speculative decoding never changes greedy output, keeps the KV pool whole, and
reports what it accepted."""

from __future__ import annotations

import pytest

from tests.engine_run import run_staggered
from tokenmill import SamplingParams
from tokenmill.config import DEFAULT_MODEL_DIR
from tokenmill.engine.engine import LLMEngine

# Repetitive prompts give n-gram lookup something to find; the others give it nothing.
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    list(range(3, 40)),
    [11, 12, 13] * 12,
    [20, 21, 22, 23, 20, 21, 22, 23, 24, 25, 26, 20, 21],
    list(range(50, 63)),
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def make_engine(model_dir, **options) -> LLMEngine:
    options.setdefault("block_size", 8)
    return LLMEngine.from_kwargs(str(model_dir), progress=False, **options)


def run(engine: LLMEngine, prompts, params=GREEDY, arrivals=None) -> list[list[int]]:
    return run_staggered(engine, prompts, params, arrivals)


@pytest.fixture(scope="module")
def reference(llama_dir) -> list[list[int]]:
    return run(make_engine(llama_dir), PROMPTS)


def spec_options(method: str, model_factory, llama_dir, eagle_head_dir=None) -> dict:
    if method == "eagle":  # a random head: it exercises the feature path, rarely right
        return {"speculative_method": "eagle", "speculative_model": str(eagle_head_dir)}
    if method == "ngram":
        return {"speculative_method": "ngram", "prompt_lookup_min": 1}
    if method == "draft_self":  # the target as its own draft: nearly everything accepted
        return {"speculative_method": "draft", "speculative_model": str(llama_dir)}
    # A different model with the same vocabulary: mostly rejected.
    return {"speculative_method": "draft", "speculative_model": str(model_factory("qwen2"))}


METHODS = ["ngram", "draft_self", "draft_other", "eagle"]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_alone_is_token_identical(llama_dir, model_factory, eagle_head_dir, reference,
                                         method):
    engine = make_engine(llama_dir, spec_adaptive=False,
                         **spec_options(method, model_factory, llama_dir, eagle_head_dir))
    for index, prompt in enumerate(PROMPTS):
        assert run(engine, [prompt]) == [reference[index]], f"prompt {index}"
    stats = engine.stats
    assert stats.spec_draft_tokens > 0
    if method == "draft_self":
        assert stats.spec_acceptance_rate > 0.9
    if method in ("draft_other", "eagle"):
        assert stats.spec_acceptance_rate < 0.9  # rejections, hence rollbacks, happened


@pytest.mark.parametrize("method", METHODS)
def test_greedy_mixed_batch_chunked_and_cached(llama_dir, model_factory, eagle_head_dir,
                                               reference, method):
    # Staggered arrivals, small chunks, a tight token budget (drafts get cut), prefix
    # caching on, and requests that cannot speculate (penalties) in the same batches.
    engine = make_engine(llama_dir, chunk_size=5, max_num_batched_tokens=24, spec_adaptive=False,
                         **spec_options(method, model_factory, llama_dir, eagle_head_dir))
    penalised = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                               repetition_penalty=1.3)
    prompts = PROMPTS + [PROMPTS[2]]
    params = [GREEDY] * len(PROMPTS) + [penalised]
    outputs = run(engine, prompts, params, arrivals=[0, 0, 2, 3, 7, 1])
    assert outputs[:len(PROMPTS)] == reference
    alone = run(make_engine(llama_dir), [PROMPTS[2]], penalised)[0]
    assert outputs[-1] == alone


def test_preemption_with_speculation_is_token_identical(llama_dir, reference):
    # A pool too small for everyone: requests are preempted and recomputed mid-speculation.
    engine = make_engine(llama_dir, num_blocks=14, speculative_method="ngram",
                         prompt_lookup_min=1, spec_adaptive=False)
    assert run(engine, PROMPTS) == reference
    assert engine.scheduler.num_preemptions > 0


def test_sampled_speculation_runs_clean_and_seeded(llama_dir):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, ignore_eos=True, seed=7)
    first = run(make_engine(llama_dir, speculative_method="draft",
                            speculative_model=str(llama_dir), spec_adaptive=False),
                PROMPTS[:3], params)
    again = run(make_engine(llama_dir, speculative_method="draft",
                            speculative_model=str(llama_dir), spec_adaptive=False),
                PROMPTS[:3], params)
    assert first == again
    assert all(len(tokens) == 30 for tokens in first)


@pytest.mark.parametrize("method", ["draft_other", "eagle"])
def test_seeded_sampled_speculation_does_not_depend_on_the_batch(llama_dir, model_factory,
                                                                  eagle_head_dir, method):
    seeded = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=11)
    others = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    options = spec_options(method, model_factory, llama_dir, eagle_head_dir)
    alone = run(make_engine(llama_dir, spec_adaptive=False, **options), [PROMPTS[1]], seeded)
    crowd = run(make_engine(llama_dir, spec_adaptive=False, **options), PROMPTS[:3],
                [others, seeded, others])
    assert crowd[1] == alone[0]


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_gives_the_same_text_with_speculation_on_or_off(
        llama_dir, model_factory, eagle_head_dir, method):
    """A seeded request's draws are keyed by position, and its drafts are verified by
    sampling and comparing: the adaptive switch (which changes k with wall-clock
    timings), the batch and the method change nothing. Penalties, min_tokens and a
    logit bias apply to verification rows as to plain decoding."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=32, seed=s,
                             ignore_eos=True) for s in range(len(PROMPTS))]
    params[1] = SamplingParams(temperature=0.8, max_tokens=32, seed=99, min_tokens=20,
                               repetition_penalty=1.2, frequency_penalty=0.3,
                               logit_bias={7: 2.0, 11: -100.0})
    plain = run(make_engine(llama_dir), PROMPTS, params, arrivals=[0, 1, 1, 3, 4])
    engine = make_engine(llama_dir, **spec_options(method, model_factory, llama_dir,
                                                   eagle_head_dir))
    assert run(engine, PROMPTS, params, arrivals=[0, 1, 1, 3, 4]) == plain
    assert 11 not in plain[1]
    assert engine.stats.spec_draft_tokens > 0


def test_logprobs_and_stop_inside_accepted_drafts(llama_dir, reference):
    # The stop token sits in the middle of what the draft (the target itself) proposes:
    # nothing after it may leak, and every emitted token carries its logprob.
    stop_at = reference[1][10]
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_at], logprobs=2)
    engine = make_engine(llama_dir, speculative_method="draft",
                         speculative_model=str(llama_dir), spec_adaptive=False)
    engine.add_request("r", PROMPTS[1], params)
    output = engine.run_to_completion()["r"].outputs[0]
    expected = reference[1][:reference[1].index(stop_at) + 1]
    assert output.token_ids == expected
    assert [lp.token_id for lp in output.logprobs] == expected
    plain = make_engine(llama_dir)
    plain.add_request("r", PROMPTS[1], params)
    reference_lps = plain.run_to_completion()["r"].outputs[0].logprobs
    for got, want in zip(output.logprobs, reference_lps, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


def test_max_tokens_is_never_exceeded(llama_dir):
    engine = make_engine(llama_dir, speculative_method="draft", speculative_model=str(llama_dir),
                         spec_adaptive=False, num_speculative_tokens=8)
    for max_tokens in (1, 2, 5, 9):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert len(run(engine, [PROMPTS[0]], params)[0]) == max_tokens


def test_acceptance_statistics_add_up(llama_dir):
    engine = make_engine(llama_dir, speculative_method="ngram", prompt_lookup_min=1,
                         spec_adaptive=False)
    outputs = run(engine, PROMPTS)
    stats = engine.stats
    assert sum(stats.spec_drafted_by_position) == stats.spec_draft_tokens
    assert sum(stats.spec_accepted_by_position) == stats.spec_accepted_tokens
    # Acceptance can only fall with depth: position i+1 is verified only after i accepted.
    accepted = stats.spec_accepted_by_position
    assert all(a >= b for a, b in zip(accepted, accepted[1:], strict=False))
    assert stats.generation_tokens == sum(len(o) for o in outputs)


def test_bad_speculative_model_is_a_clear_error(llama_dir, tmp_path, model_factory):
    with pytest.raises(ValueError, match="speculative_model"):
        make_engine(llama_dir, speculative_method="draft", speculative_model=str(tmp_path))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_engine(llama_dir, speculative_method="ngram", num_speculative_tokens=0)


def test_embedded_model_with_its_draft_is_token_identical():
    prompt = "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n"
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLMEngine.from_kwargs(str(DEFAULT_MODEL_DIR), progress=False)
    expected = run(plain, [plain.encode(prompt)], params)
    for method in ("ngram", "draft", "eagle"):
        engine = LLMEngine.from_kwargs(str(DEFAULT_MODEL_DIR), progress=False,
                                       speculative_method=method, spec_adaptive=False)
        assert run(engine, [engine.encode(prompt)], params) == expected, method
        assert engine.stats.spec_accepted_tokens > 0, method


def test_eagle_restarting_on_recent_positions_keeps_greedy_output(llama_dir, eagle_head_dir,
                                                                 reference, monkeypatch):
    """After a long backlog (here: any prompt over 8 tokens) the EAGLE head restarts on
    the latest positions; drafts change, the verified output does not."""
    from tokenmill.speculative.eagle import proposer as eagle

    monkeypatch.setattr(eagle, "MAX_CATCH_UP", 8)
    rebased = []
    real = eagle.EagleProposer._rebase
    monkeypatch.setattr(eagle.EagleProposer, "_rebase",
                        lambda self, seq, drop: rebased.append(drop) or real(self, seq, drop))
    engine = make_engine(llama_dir, spec_adaptive=False, speculative_method="eagle",
                         speculative_model=str(eagle_head_dir))
    assert run(engine, PROMPTS) == reference
    assert rebased and engine.stats.spec_draft_tokens > 0


def test_draft_restarting_on_recent_tokens_keeps_greedy_output(llama_dir, reference,
                                                               monkeypatch):
    """A draft model's shadow starts (and, after a long gap, restarts) on the latest
    MAX_CATCH_UP tokens: its drafts change, the verified output does not."""
    from tokenmill.speculative import draft

    monkeypatch.setattr(draft, "MAX_CATCH_UP", 8)
    offsets = []
    real = draft.DraftModelProposer._sync

    def sync(self, request):
        shadow = real(self, request)
        offsets.append(shadow.offset)
        assert shadow.all_token_ids == request.token_ids[offsets[-1]:]
        return shadow

    monkeypatch.setattr(draft.DraftModelProposer, "_sync", sync)
    engine = make_engine(llama_dir, spec_adaptive=False, speculative_method="draft",
                         speculative_model=str(llama_dir))
    assert run(engine, PROMPTS) == reference
    assert max(offsets) > 0 and engine.stats.spec_accepted_tokens > 0


def test_eagle_with_gaps_in_the_features_keeps_greedy_output(llama_dir, eagle_head_dir,
                                                              reference, monkeypatch):
    """While the guard keeps speculation off the head is not fed hidden states; when
    they come back after a gap it restarts on them. Drafts change, output does not."""
    from tokenmill.speculative.controller import SpecController

    calls = []

    def wants_features(self, batch):
        calls.append(batch)
        return len(calls) % 6 not in (2, 3, 4)  # 3 steps in 6 without features

    monkeypatch.setattr(SpecController, "wants_features", wants_features)
    engine = make_engine(llama_dir, spec_adaptive=False, speculative_method="eagle",
                         speculative_model=str(eagle_head_dir))
    assert run(engine, PROMPTS) == reference
    assert len(calls) > 20 and engine.stats.spec_draft_tokens > 0


def test_draft_proposes_again_when_the_target_did_not_move(llama_dir):
    """A request left out of a step keeps its tokens; proposing for it again must
    rerun the draft from its last token, not find nothing to run."""
    from tokenmill.core.step import ProposalRequest
    from tokenmill.model.loader import load_model
    from tokenmill.speculative.draft import DraftModelProposer

    draft = load_model(llama_dir, "float32", "cpu", progress=False)
    proposer = DraftModelProposer(draft, 384, num_blocks=16, block_size=8)
    request = ProposalRequest("r", list(range(5, 25)), GREEDY, 0, 4)
    first = proposer.propose([request])[0].token_ids
    assert proposer.propose([request])[0].token_ids == first  # same tokens, same guess
    request.token_ids.append(first[0])
    assert len(proposer.propose([request])[0].token_ids) == 4
    proposer.release("r")
    proposer.check_integrity(idle=True)
