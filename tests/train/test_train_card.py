"""The model card is written from a trained directory, with MoE expert load."""

from __future__ import annotations

import json

from tests.train.conftest import tiny_preset
from tokenmill.train.card import write_model_card
from tokenmill.train.corpus import is_held_out
from tokenmill.train.trainer import train_model


def make_corpus(root, texts):
    """A corpus directory with every text both trained on and held out."""
    names = [f"m{i}.py" for i in range(400)]
    held_out = [n for n in names if is_held_out(n)][: len(texts)]
    for name, text in zip(held_out, texts, strict=True):
        (root / name).write_text(text, encoding="utf-8")


def test_moe_card_has_expert_load_samples_and_numbers(
    tmp_path, tiny_tokenizer_dir, tiny_train_texts, tiny_held_out_texts
):
    out_dir = tmp_path / "tiny-moe"
    preset = tiny_preset("mixtral", steps=6)
    train_model(preset, tiny_tokenizer_dir, out_dir, tiny_train_texts, tiny_held_out_texts, False)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    make_corpus(corpus, tiny_held_out_texts)

    card = write_model_card(out_dir, corpus).read_text()

    for heading in (
        "## Training data and licence",
        "## Architecture",
        "## Held-out evaluation",
        "## Expert load",
        "## Sample completions",
        "![loss curve](loss_curve.png)",
    ):
        assert heading in card
    assert "PSF" in card and "MixtralForCausalLM" in card
    measured = json.loads((out_dir / "train_log.json").read_text())["card"]
    assert len(measured["samples"]) == 5
    fractions = measured["expert_load"]["fractions"]
    assert len(fractions) == 1 and abs(sum(fractions[0]) - 1.0) < 1e-9
    assert min(measured["expert_load"]["imbalance"]) >= 1.0


def test_card_of_a_continued_model_lists_both_stages(
    tmp_path, tiny_tokenizer_dir, tiny_train_texts, tiny_held_out_texts
):
    out_dir = tmp_path / "tiny-llama"
    for init_from in (None, out_dir):
        train_model(
            tiny_preset("llama", steps=4),
            tiny_tokenizer_dir,
            out_dir,
            tiny_train_texts,
            tiny_held_out_texts,
            show_progress=False,
            init_from=init_from,
        )
    card = write_model_card(out_dir).read_text()
    assert "### Stage 1 (from random initialisation)" in card
    assert "### Stage 2 (from the previous stage's weights)" in card
    assert "## Expert load" not in card
