"""Fixtures for the training tests: a tokenizer and corpus of a few KB."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.train.corpus import stdlib_root
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
