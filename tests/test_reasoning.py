"""The reasoning parser and the thinking bookkeeping on their own (tokenmill/reasoning.py),
and the validation of the thinking fields of SamplingParams."""

from __future__ import annotations

import pytest

from tokenmill import SamplingParams
from tokenmill.reasoning import (
    ReasoningMarkers,
    ThinkingTokens,
    declared_markers,
    find_ids,
    forced_sequence,
    prompt_opens_thinking,
    split_reasoning,
    thinking_progress,
)

MARKERS = ReasoningMarkers()
TEXTS = [
    "<think>\na = 6\nb = 18\n</think>\n19",
    "<think>x < y and </thin is not </think> the end</think>answer",
    "no thinking at all, just < and <thi and </ in text",
    "<think>cut short by max_tokens </th",
    "  \n<think>\n\n</think>\n\n  42",
    "prefix <think>middle</think> suffix <think>again</think>",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_split_grows_by_appending_and_ends_at_the_full_split(text):
    """Every prefix's split is a prefix of the final split: a stream of differences
    never shows (and so never has to take back) a partial marker."""
    final_reasoning, final_content = split_reasoning(text, MARKERS)
    for cut in range(len(text) + 1):
        reasoning, content = split_reasoning(text[:cut], MARKERS, finished=False)
        assert final_content.startswith(content), (cut, content)
        assert (final_reasoning or "").startswith(reasoning or ""), (cut, reasoning)


def test_split_examples():
    assert split_reasoning(TEXTS[0], MARKERS) == ("a = 6\nb = 18\n", "19")
    assert split_reasoning(TEXTS[1], MARKERS) == ("x < y and </thin is not ", "the end</think>answer")
    assert split_reasoning(TEXTS[2], MARKERS) == (None, TEXTS[2])
    assert split_reasoning(TEXTS[3], MARKERS) == ("cut short by max_tokens </th", "")
    assert split_reasoning(TEXTS[3], MARKERS, finished=False) == ("cut short by max_tokens ", "")
    assert split_reasoning(TEXTS[4], MARKERS) == ("", "42")
    # A template that writes <think> into the prompt: the output starts in the thinking.
    assert split_reasoning("plan\n</think>\nok", MARKERS, open_at_start=True) == ("plan\n", "ok")
    assert split_reasoning("plan", MARKERS, open_at_start=True) == ("plan", "")
    other = ReasoningMarkers("[[", "]]")
    assert split_reasoning("[[a]]b", other) == ("a", "b")


THINKING = ThinkingTokens(start_ids=(7,), end_ids=(8, 9), bridge_ids=(3,))


def test_thinking_progress_counts_tokens_between_the_markers():
    assert thinking_progress([1, 2], THINKING) == thinking_progress([], THINKING)
    assert not thinking_progress([1, 2], THINKING).started
    progress = thinking_progress([1, 7, 4, 4, 4], THINKING)
    assert progress.started and not progress.ended and progress.num_thinking_tokens == 3
    progress = thinking_progress([7, 4, 4, 8, 9, 5, 7, 4], THINKING)
    assert progress.ended and progress.num_thinking_tokens == 2
    # A lone first token of a multi-token end marker does not end the thinking.
    assert not thinking_progress([7, 8, 4], THINKING).ended
    opened = ThinkingTokens((7,), (8, 9), open_at_start=True)
    assert thinking_progress([4, 4, 8, 9], opened).num_thinking_tokens == 2


def test_prompt_opens_thinking_and_find_ids():
    assert find_ids([1, 8, 9, 8, 9], [8, 9], 2) == 3
    assert find_ids([1, 2], [2, 3]) == -1
    assert prompt_opens_thinking([1, 7, 2], THINKING)
    assert not prompt_opens_thinking([1, 7, 2, 8, 9, 4], THINKING)
    assert prompt_opens_thinking([7, 8, 9, 7], THINKING)
    assert not prompt_opens_thinking([1, 2, 3], THINKING)


def test_forced_sequence_keeps_the_bridge_only_when_it_fits_the_budget():
    assert forced_sequence(THINKING, 1) == (3, 8, 9)
    assert forced_sequence(THINKING, 0) == (8, 9)


def test_a_model_declares_its_markers_or_has_both_tokens():
    declared = declared_markers({"reasoning": {"start": "<s1>", "end": "</s1>", "bridge": "\n"}},
                                {})
    assert declared == ReasoningMarkers("<s1>", "</s1>", "\n")
    assert declared_markers({}, {"<think>": 5, "</think>": 6}) == ReasoningMarkers()
    assert declared_markers({}, {"<think>": 5}) is None
    with pytest.raises(ValueError, match="reasoning.end"):
        declared_markers({"reasoning": {"end": ""}}, {})


@pytest.mark.parametrize(("fields", "name"), [
    ({"thinking_budget": -1}, "thinking_budget"),
    ({"thinking_budget": True}, "thinking_budget"),
    ({"thinking_budget": 2.5}, "thinking_budget"),
    ({"thinking_budget": 2**31}, "thinking_budget"),
    ({"min_thinking": -3}, "min_thinking"),
    ({"min_thinking": 9, "thinking_budget": 8}, "min_thinking"),
    ({"thinking_bridge": 5}, "thinking_bridge"),
])
def test_bad_thinking_fields_are_a_value_error_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        SamplingParams(**fields)


def test_thinking_control_makes_the_engine_send_the_history():
    assert not SamplingParams().reads_history
    assert SamplingParams(thinking_budget=0).reads_history
    assert SamplingParams(min_thinking=3).reads_history
    assert SamplingParams(presence_penalty=0.5).reads_history
    assert not SamplingParams(thinking_bridge="\n").controls_thinking
