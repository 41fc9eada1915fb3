"""The long-context tasks: pure functions of the seed, the facts planted where and as
often as said, the answer recoverable from the context, lengths as asked."""

from __future__ import annotations

import inspect
import json
import random as random_module
import re

import pytest

from tokenmill.train.longctx_tasks import KINDS, make_item, make_items, score

TEXTS = [inspect.getsource(random_module), inspect.getsource(json.decoder),
         inspect.getsource(re)]


def count_tokens(text: str) -> int:
    return max(1, len(text) // 4)


def context_of(item) -> list[str]:
    return item.prompt.splitlines()[:-1]


@pytest.mark.parametrize("kind", KINDS)
def test_items_are_a_function_of_the_seed(kind):
    length = 6000 if kind == "code" else 2000  # code: a prefix long enough to ask about
    first = make_item(kind, 3, TEXTS, length, count_tokens)
    assert first == make_item(kind, 3, TEXTS, length, count_tokens)
    others = make_items(kind, 4, 10, TEXTS, length, count_tokens)
    if kind != "code":  # (code items vary with the files that qualify: here one)
        assert len({item.prompt for item in others}) == 4


@pytest.mark.parametrize("length", [1000, 4000])
@pytest.mark.parametrize("kind", ["needle", "multi-key", "multi-value"])
def test_contexts_have_the_length_asked(kind, length):
    item = make_item(kind, 1, TEXTS, length, count_tokens)
    assert 0.8 * length <= count_tokens(item.prompt) <= 1.1 * length


def test_a_needle_is_planted_once_at_its_depth():
    item = make_item("needle", 7, TEXTS, 3000, count_tokens)
    name = re.search(r"assert (KEY_\w+) ==$", item.prompt).group(1)
    lines = context_of(item)
    facts = [i for i, line in enumerate(lines) if line.startswith("KEY_")]
    assert len(facts) == 1 and lines[facts[0]] == f"{name} = {item.answer}"
    assert abs(facts[0] / len(lines) - item.depths[0]) < 0.02
    assert re.fullmatch(r"\d{5}", item.answer)


def test_multi_key_hides_the_key_among_distinct_distractors():
    item = make_item("multi-key", 2, TEXTS, 3000, count_tokens, distractors=6)
    name = re.search(r"assert (KEY_\w+) ==$", item.prompt).group(1)
    facts = dict(line.split(" = ") for line in context_of(item) if line.startswith("KEY_"))
    assert len(facts) == 7 and len(set(facts.values())) == 7
    assert facts[name] == item.answer


def test_multi_value_lists_every_value_in_context_order():
    item = make_item("multi-value", 5, TEXTS, 3000, count_tokens, values=4)
    appended = re.findall(r"^KEY_\w+\.append\((\d+)\)$", item.prompt, re.MULTILINE)
    assert len(appended) == 4
    assert item.answer == ", ".join(appended) + "]"
    assert item.prompt.endswith(" == [") and list(item.depths) == sorted(item.depths)


def test_the_code_task_asks_for_an_early_literal_of_the_file():
    item = make_item("code", 0, TEXTS, 6000, count_tokens)
    name = re.search(r"assert (\w+) ==$", item.prompt).group(1)
    lines = context_of(item)
    defining = [i for i, line in enumerate(lines) if line.startswith(f"{name} = ")]
    assert len(defining) == 1 and lines[defining[0]].startswith(f"{name} = {item.answer}")
    assert defining[0] < len(lines) / 5
    assert any("\n".join(lines) in text for text in TEXTS)  # a prefix of a real file


def test_score_reads_the_first_line_of_the_completion():
    item = make_item("needle", 1, TEXTS, 1000, count_tokens)
    assert score(item, f"{item.answer}\nprint('done')")
    assert score(item, f" {item.answer}  # yes")
    assert not score(item, f"\n{item.answer}")
    assert not score(item, "12345" if item.answer != "12345" else "54321")
    # The answer must end where the line's expression ends.
    assert not score(item, f" {item.answer}9")
    assert not score(item, f" {item.answer}.5")
    assert not score(item, f" {item.answer} + 1")
    assert score(item, f" {item.answer}   ")


def test_bad_requests_name_what_is_wrong():
    with pytest.raises(ValueError, match="kind"):
        make_item("haystack", 0, TEXTS, 1000, count_tokens)
    with pytest.raises(ValueError, match="texts"):
        make_item("needle", 0, [], 1000, count_tokens)
    with pytest.raises(ValueError, match="code"):
        make_item("code", 0, ["x = 1\n"], 1000, count_tokens)
