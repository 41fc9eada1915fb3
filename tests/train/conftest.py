"""Fixtures for the training tests: a tokenizer and corpus of a few KB."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.train.corpus import stdlib_root
from tokenmill.train.presets import Phase, Preset, Schedule
from tokenmill.train.tokenizer import save_tokenizer, train_bpe

torch.set_num_threads(2)

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMITTED_MODELS = ("pycoder", "pycoder-draft", "pycoder-moe")
# Small, stable stdlib modules: a few KB of ordinary Python for a tiny corpus.
TINY_CORPUS_MODULES = ("bisect.py", "colorsys.py", "keyword.py", "this.py")
TINY_HELD_OUT_MODULE = "stat.py"


@pytest.fixture(scope="session")
def tiny_train_texts() -> list[str]:
    root = stdlib_root()
    return [(root / name).read_text(encoding="utf-8") for name in TINY_CORPUS_MODULES]


@pytest.fixture(scope="session")
def tiny_held_out_texts() -> list[str]:
    return [(stdlib_root() / TINY_HELD_OUT_MODULE).read_text(encoding="utf-8")[:3000]]


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory, tiny_train_texts) -> Path:
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    save_tokenizer(train_bpe(tiny_train_texts, vocab_size=400), path)
    return path


def committed_model_dir(name: str) -> Path:
    """The committed model directory, skipping the test when it is not there yet."""
    path = REPO_ROOT / "models" / name
    if not (path / "model.safetensors").is_file():
        pytest.skip(f"models/{name} is not trained yet (run scripts/train_default_models.sh)")
    return path


TINY_CONFIG = {
    "vocab_size": 400,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}


def tiny_preset(architecture: str, steps: int) -> Preset:
    config = dict(TINY_CONFIG)
    if architecture == "mixtral":
        config |= {"num_local_experts": 4, "num_experts_per_tok": 2}
    schedule = Schedule(
        phases=(
            Phase(steps=steps, seq_len=64, batch_size=4),
            Phase(steps=2, seq_len=128, batch_size=2),
        ),
        peak_lr=1e-2,
        warmup_steps=5,
        eval_every=20,
        eval_windows=2,
        eval_seq_len=64,
    )
    return Preset(f"tiny-{architecture}", architecture, config, schedule, "test model")
