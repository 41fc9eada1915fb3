"""Extending a model to long context (train/longctx.py): rows hold one task item with
its answer masked for the extra loss term, the loss without that term is transformers'
own, and a short run writes a model with the larger RoPE base that tokenmill serves
token for token as transformers does."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.train.conftest import tiny_preset
from tokenmill import LLM, SamplingParams
from tokenmill.train.longctx import (
    FACT,
    LongContextRecipe,
    LongPhase,
    RowMaker,
    answer_text,
    task_accuracy,
    train_long_context,
    weighted_loss,
)
from tokenmill.train.longctx_card import write_longctx_card
from tokenmill.train.longctx_tasks import make_item
from tokenmill.train.tokenizer import load_tokenizer
from tokenmill.train.trainer import train_model

RECIPE = LongContextRecipe(phases=(LongPhase(4, 256, 2, 0.5), LongPhase(2, 512, 1, 0.5)),
                           rope_theta=40_000.0, max_position_embeddings=512,
                           warmup_steps=2, task_share=1.0)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, tiny_tokenizer_dir, tiny_train_texts, tiny_held_out_texts):
    out = tmp_path_factory.mktemp("longctx_base") / "base"
    train_model(tiny_preset("llama", 5), tiny_tokenizer_dir, out, tiny_train_texts,
                tiny_held_out_texts, show_progress=False)
    return out


def code_tokens(tokenizer, texts: list[str]) -> torch.Tensor:
    return torch.tensor([t for text in texts
                         for t in tokenizer.backend_tokenizer.encode(text).ids])


def test_a_task_row_masks_exactly_its_answer(tiny_tokenizer_dir, tiny_train_texts):
    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    code = code_tokens(tokenizer, tiny_train_texts)
    rows = RowMaker(tokenizer, tiny_train_texts, code, replace(RECIPE, task_share=1.0))
    again = RowMaker(tokenizer, tiny_train_texts, code, replace(RECIPE, task_share=1.0))
    for _ in range(6):
        ids, mask, kinds = rows.batch(256, 2)
        assert torch.equal(ids, again.batch(256, 2)[0])  # seeded
        assert ids.shape == mask.shape == (2, 256)
        for row_ids, row_mask, kind in zip(ids.tolist(), mask.tolist(), kinds, strict=True):
            answer = [t for t, m in zip(row_ids, row_mask, strict=True) if m]
            assert bool(answer) == (kind is not None)
            if not answer:  # a `code` item with no usable file: a plain code row
                continue
            text = tokenizer.decode(answer)
            assert text.endswith("\n") and text.strip()
            first = row_mask.index(1)
            assert all(row_mask[first:first + len(answer)])  # one contiguous answer
    item = make_item("needle", 1, tiny_train_texts, 200, rows.count)
    assert answer_text(item) == f" {item.answer}\n"


def test_extra_questions_ask_other_planted_keys_with_their_values(tiny_tokenizer_dir,
                                                                  tiny_train_texts):
    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    code = code_tokens(tokenizer, tiny_train_texts)
    recipe = replace(RECIPE, extra_questions=3, kind_weights=(0.0, 1.0, 0.0, 0.0))
    rows = RowMaker(tokenizer, tiny_train_texts, code, recipe)
    asked = 0
    for _ in range(4):
        ids, mask, kinds = rows.batch(512, 2)
        for row_ids, row_mask, kind in zip(ids.tolist(), mask.tolist(), kinds, strict=True):
            if kind is None:  # the item ran past the row: a plain code row
                continue
            assert kind == "multi-key"
            text = tokenizer.decode(row_ids[:max(i for i, m in enumerate(row_mask) if m) + 1])
            facts = dict(FACT.findall(text))
            questions = re.findall(r"^assert KEY_(\w+) == (\d+)$", text, re.MULTILINE)
            # The item's own and up to 3 more, as many as the row has room for.
            assert 1 <= len(questions) <= 4
            room = 512 - len(tokenizer.encode(text, add_special_tokens=False))
            assert len(questions) == min(4, len(facts)) or room < 2 * len(tokenizer.encode(
                f"assert KEY_{questions[0][0]} == {questions[0][1]}\n",
                add_special_tokens=False))
            assert len({name for name, _ in questions}) == len(questions)
            for name, value in questions:  # every answer is the value planted for its key
                assert facts[name] == value
            answers = tokenizer.decode([t for t, m in zip(row_ids, row_mask, strict=True) if m])
            assert answers.split() == [value for _, value in questions]
            asked += len(questions) - 1
    assert asked >= 8
    with pytest.raises(ValueError, match="kind_weights"):
        replace(RECIPE, kind_weights=(1.0, 1.0))
    with pytest.raises(ValueError, match="extra_questions"):
        replace(RECIPE, extra_questions=-1)


def test_a_later_stage_with_another_seed_draws_other_items(tiny_tokenizer_dir,
                                                          tiny_train_texts):
    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    code = code_tokens(tokenizer, tiny_train_texts)
    first = RowMaker(tokenizer, tiny_train_texts, code, replace(RECIPE, seed=1))
    second = RowMaker(tokenizer, tiny_train_texts, code, replace(RECIPE, seed=2))
    seeds = set()
    for rows in (first, second):
        for _ in range(5):
            rows.items += 1
            seeds.add(rows.item_seed)
    assert len(seeds) == 10  # no item seed of stage 1 comes back in stage 2


def test_without_the_answer_term_the_loss_is_transformers_own(base_model):
    model = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
    ids = torch.randint(1, 400, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 40)
    loss, answer, _ = weighted_loss(model, ids, mask, answer_weight=1.0)
    torch.testing.assert_close(loss, model(input_ids=ids, labels=ids).loss)
    mask[:, 30:33] = 1
    mask[1, 33] = 1
    loss, answer, per_row = weighted_loss(model, ids, mask, answer_weight=1.0)
    logits = model(input_ids=ids).logits[:, :-1]
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    picked = torch.cat([ce[0, 29:32], ce[1, 29:33]])
    torch.testing.assert_close(torch.tensor(answer), picked.mean())
    torch.testing.assert_close(loss, ce.mean() + picked.mean())
    torch.testing.assert_close(torch.tensor(per_row), torch.stack([ce[0, 29:32].mean(),
                                                                   ce[1, 29:33].mean()]))


def test_a_short_run_extends_the_context_and_serves_like_transformers(
        base_model, tmp_path, tiny_train_texts, tiny_held_out_texts):
    out = tmp_path / "long"
    log = train_long_context(base_model, out, tiny_train_texts, tiny_held_out_texts, RECIPE)
    assert log["stages"][0]["phase_steps"] == [4, 2]
    assert set(log["held_out_after"]) == {"512"}
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 40_000.0
    assert config["max_position_embeddings"] == 512
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    prompt = torch.randint(1, 400, (1, 300), generator=torch.Generator().manual_seed(1))
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False,
                              pad_token_id=0)[0, 300:].tolist()
    llm = LLM(str(out), progress=False)
    got = llm.generate([prompt[0].tolist()], SamplingParams(temperature=0, max_tokens=8,
                                                            ignore_eos=True))
    assert list(got[0].outputs[0].token_ids) == expected
    llm.engine.shutdown()
    # The card renders what the log holds.
    card = write_longctx_card(out).read_text()
    assert "| 1 | 4 / 4 | 256 | 2 |" in card and "| 2 | 2 / 2 | 512 | 1 |" in card
    assert "RoPE base raised from 10000 to 40000" in card
    assert (out / "loss_curve.png").is_file()
    # A second stage continues the log: both stages, one curve.
    again = train_long_context(out, tmp_path / "longer", tiny_train_texts,
                               tiny_held_out_texts,
                               replace(RECIPE, phases=RECIPE.phases[:1], extra_questions=2,
                                       kind_weights=(1.0, 3.0, 1.0, 1.0)))
    assert [s["phase_steps"] for s in again["stages"]] == [[4, 2], [4]]
    assert [h["step"] for h in again["history"]] == list(range(1, 11))
    assert again["init_from"] == str(base_model)
    card = write_longctx_card(tmp_path / "longer").read_text()
    first, second = card.split("Stage 2")  # each stage says its own task mix
    assert "asked too" not in first and "in proportion" not in first
    assert "up to 2 of its other planted keys asked too" in second
    assert "in proportion needle 1, multi-key 3, multi-value 1, code 1." in second


def test_the_task_knobs_are_checked_when_the_command_line_is_read(capsys):
    from tokenmill.train.cli import _build_parser

    parser = _build_parser()
    base = ["longctx", "--init-from", "a", "--out", "b"]
    args = parser.parse_args(base + ["--kind-weights", "multi-key:4,code:0.5",
                                     "--extra-questions", "8"])
    assert args.kind_weights == (1.0, 4.0, 1.0, 0.5) and args.extra_questions == 8
    for flag, value, message in (("--kind-weights", "multikey:2", "unknown kind 'multikey'"),
                                 ("--kind-weights", "code:x", "is not KIND:WEIGHT"),
                                 ("--kind-weights", "code:-1", "weights >= 0"),
                                 ("--kind-weights", "needle:0,multi-key:0,multi-value:0,code:0",
                                  "not all zero"),
                                 ("--extra-questions", "-2", "must be >= 0")):
        with pytest.raises(SystemExit):
            parser.parse_args(base + [flag, value])
        assert message in capsys.readouterr().err



def test_task_accuracy_scores_each_item_by_its_own_completion(tiny_held_out_texts):
    """The held-out scoring behind the model card: each item's completion is scored
    against that item (strictly: an extra digit is wrong), per kind and length."""
    from types import SimpleNamespace

    from tokenmill.train.longctx_tasks import make_items

    def count(text: str) -> int:
        return len(text.split())

    answers = {}
    for kind in ("needle", "multi-key"):
        for item in make_items(kind, 4, 0, tiny_held_out_texts, 120, count):
            answers[item.prompt] = item.answer

    def generate(prompts, params):
        assert params.temperature == 0
        # Items 0 and 2 of a batch answered right, 1 with a digit too many, 3 wrong.
        forms = ("{} {}\n", "{} {}7\n", "{} {}  # ok", "{} 0\n")
        return [SimpleNamespace(outputs=[SimpleNamespace(
                    text=forms[i % 4].format("", answers[prompt]))])
                for i, prompt in enumerate(prompts)]

    llm = SimpleNamespace(engine=SimpleNamespace(encode=str.split), generate=generate)
    got = task_accuracy(llm, tiny_held_out_texts, (120,), 4, kinds=("needle", "multi-key"))
    assert got == {"needle": {"120": 0.5}, "multi-key": {"120": 0.5}}
