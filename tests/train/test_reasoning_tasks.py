"""The reasoning task family: seeded, answers that check against Python itself,
thinking that grows with the level, and a tokenizer that keeps digits and markers whole."""

from __future__ import annotations

import random
import statistics

import pytest
from transformers import AutoTokenizer

from tokenmill.train.reasoning_data import CHAT_TEMPLATE, build_reasoning_tokenizer
from tokenmill.train.reasoning_tasks import (
    LEVELS,
    MAX_VALUE,
    count_statements,
    generate_item,
    generate_items,
    parse_answer,
    run_program,
)


def test_items_are_a_pure_function_of_the_seed():
    assert generate_items(7, 40) == generate_items(7, 40)
    assert generate_items(7, 40) != generate_items(8, 40)


def test_answers_and_every_trace_value_check_against_python():
    for item in generate_items(3, 600):
        assert run_program(item.program) == item.answer
        assert count_statements(item) == item.level
        # Replaying the program line by line gives the trace's values in order.
        env: dict = {}
        values = []
        for line in item.program.splitlines()[:-1]:
            exec(line, {}, env)  # noqa: S102 - generated arithmetic
            target = line.split()[0]
            values.append(env[target])
        assert [t.value for t in item.trace[:-1]] == values
        assert all(0 <= v <= MAX_VALUE for v in values + [item.answer])


def test_thinking_grows_with_the_level_and_holds_the_answer_last():
    items = generate_items(11, 1200)
    means = [statistics.mean(len(i.thinking) for i in items if i.level == level)
             for level in LEVELS]
    assert means == sorted(means) and means[-1] > 2.5 * means[0]
    for item in items[:50]:
        assert item.completion.startswith("<think>\n")
        assert item.completion.endswith(f"</think>\n{item.answer}")
        assert item.thinking.splitlines()[-1].endswith(f"= {item.answer}")
        assert parse_answer(item.completion.split("</think>")[1]) == item.answer


def test_terse_items_think_in_fewer_characters():
    rng = random.Random(0)
    verbose = generate_item(rng, 4, verbose_probability=1.0)
    terse = generate_item(random.Random(0), 4, verbose_probability=0.0)
    assert verbose.program == terse.program and verbose.answer == terse.answer
    assert len(terse.thinking) < len(verbose.thinking)


def test_bad_level_is_a_value_error():
    with pytest.raises(ValueError, match="level"):
        generate_item(random.Random(0), 9)


def test_tokenizer_keeps_digits_single_and_markers_whole(tmp_path):
    build_reasoning_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    item = generate_items(5, 6)[-1]
    ids = tokenizer(item.chat_text(), add_special_tokens=False)["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert "<think>" in pieces and "</think>" in pieces
    assert not any(p.lstrip("Ġ").isdigit() and len(p.lstrip("Ġ")) > 1 for p in pieces)
    # Markers stay in decoded text (the parser reads them); the roles do not.
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert "<think>" in decoded and "<|user|>" not in decoded
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": item.program}],
                                           add_generation_prompt=True, tokenize=False)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert item.chat_text().startswith(prompt) and prompt.endswith("<|assistant|>\n")
