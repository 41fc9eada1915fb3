"""A tiny seeded training run lowers the loss and writes a loadable model directory."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.train.conftest import tiny_preset
from tokenmill.train.clock import TrainingClock, learning_rate
from tokenmill.train.evaluation import expert_load, imbalance_factor
from tokenmill.train.presets import Phase, Preset, Schedule
from tokenmill.train.trainer import train_model


def run(tmp_path, tokenizer_dir, train_texts, held_out_texts, architecture="llama", steps=60):
    preset = tiny_preset(architecture, steps)
    out_dir = tmp_path / preset.name
    log = train_model(
        preset, tokenizer_dir, out_dir, train_texts, held_out_texts, show_progress=False
    )
    return log, out_dir


def test_tiny_training_run_lowers_loss_and_saves_loadable_dir(
    tmp_path, tiny_tokenizer_dir, tiny_train_texts, tiny_held_out_texts
):
    log, out_dir = run(tmp_path, tiny_tokenizer_dir, tiny_train_texts, tiny_held_out_texts)
    losses = log["history"]["train_loss"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert (
        log["history"]["eval_loss"][-1] < log["history"]["eval_loss"][0] + 1e-6
        or len(log["history"]["eval_loss"]) == 1
    )
    assert log["held_out"]["512"]["perplexity"] == pytest.approx(
        math.exp(log["held_out"]["512"]["loss"])
    )
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "train_log.json",
        "loss_curve.png",
    ):
        assert (out_dir / name).is_file(), name
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    generation = json.loads((out_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == generation["bos_token_id"] == 0

    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    logits = model(**tokenizer("def f(x):\n", return_tensors="pt")).logits
    assert torch.isfinite(logits).all()


def test_training_is_reproducible_with_the_same_seed(
    tmp_path, tiny_tokenizer_dir, tiny_train_texts, tiny_held_out_texts
):
    first, _ = run(
        tmp_path / "a", tiny_tokenizer_dir, tiny_train_texts, tiny_held_out_texts, steps=8
    )
    second, _ = run(
        tmp_path / "b", tiny_tokenizer_dir, tiny_train_texts, tiny_held_out_texts, steps=8
    )
    assert first["history"]["train_loss"] == second["history"]["train_loss"]


def test_tiny_moe_run_trains_and_reports_expert_load(
    tmp_path, tiny_tokenizer_dir, tiny_train_texts, tiny_held_out_texts
):
    log, out_dir = run(
        tmp_path, tiny_tokenizer_dir, tiny_train_texts, tiny_held_out_texts, "mixtral", steps=30
    )
    losses = log["history"]["train_loss"]
    assert sum(losses[-5:]) < sum(losses[:5])
    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    windows = torch.randint(1, 400, (2, 32), generator=torch.Generator().manual_seed(0))
    fractions = expert_load(model, windows, batch_size=2)
    assert len(fractions) == 1 and len(fractions[0]) == 4
    assert sum(fractions[0]) == pytest.approx(1.0)
    assert imbalance_factor(fractions[0]) >= 1.0


def test_learning_rate_warms_up_then_decays_to_the_floor():
    schedule = tiny_preset("llama", 98).schedule  # 98 + 2 = 100 steps
    clock = TrainingClock(schedule)
    total = schedule.total_steps
    assert learning_rate(0, 0.0, schedule) == pytest.approx(schedule.peak_lr / 5)
    assert learning_rate(4, 0.0, schedule) == pytest.approx(schedule.peak_lr)
    assert learning_rate(total, 1.0, schedule) == pytest.approx(
        schedule.peak_lr * schedule.min_lr_ratio
    )
    progress = [clock.progress(step, 0, step) for step in range(98)]
    clock.enter_final_phase(clock.progress(98, 0, 0))
    progress += [clock.progress(98 + i, 1, i) for i in range(2)]
    assert progress == pytest.approx([step / total for step in range(total)])
    rates = [learning_rate(step, p, schedule) for step, p in enumerate(progress)][5:]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))


def test_wall_clock_budget_stops_the_main_phase_and_still_runs_the_final_phase(
    tmp_path, tiny_tokenizer_dir, tiny_train_texts, tiny_held_out_texts
):
    preset = tiny_preset("llama", 100_000)
    log = train_model(
        preset,
        tiny_tokenizer_dir,
        tmp_path / "budget",
        tiny_train_texts,
        tiny_held_out_texts,
        show_progress=False,
        max_seconds=2.0,
    )
    (stage,) = log["stages"]
    assert 0 < stage["phase_steps"][0] < 100_000
    assert stage["phase_steps"][1] == 2


def test_schedule_rejects_out_of_range_fields():
    with pytest.raises(ValueError, match="seq_len"):
        Phase(steps=1, seq_len=4096, batch_size=1)
    with pytest.raises(ValueError, match="phases"):
        Schedule(phases=())
    with pytest.raises(ValueError, match="peak_lr"):
        tiny_preset("llama", 5).with_schedule(peak_lr=-1.0)
    with pytest.raises(ValueError, match="architecture"):
        Preset("x", "gpt2", {}, Schedule(phases=(Phase(1, 64, 1),)), "")


def test_continuing_from_a_saved_model_adds_a_stage_and_one_continuous_curve(
    tmp_path, tiny_tokenizer_dir, tiny_train_texts, tiny_held_out_texts
):
    first, out_dir = run(
        tmp_path, tiny_tokenizer_dir, tiny_train_texts, tiny_held_out_texts, steps=20
    )
    preset = tiny_preset("llama", 10).with_schedule(peak_lr=3e-3, warmup_steps=2, seed=1)
    second = train_model(
        preset,
        tiny_tokenizer_dir,
        out_dir,
        tiny_train_texts,
        tiny_held_out_texts,
        show_progress=False,
        init_from=out_dir,
    )
    assert [stage["init"] for stage in second["stages"]] == ["random", "continued"]
    assert second["steps"] == first["steps"] + 12
    assert second["tokens_seen"] == first["tokens_seen"] + second["stages"][1]["tokens_seen"]
    assert second["history"]["steps"] == list(range(1, second["steps"] + 1))
    assert second["history"]["train_loss"][: first["steps"]] == first["history"]["train_loss"]
    # Starting from trained weights, the first continued step is already far below random.
    assert second["history"]["train_loss"][first["steps"]] < first["history"]["train_loss"][0] - 1
