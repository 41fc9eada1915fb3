from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models import build_model, build_tokenizer

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory, tokenizer_dir):
    """Builds (once per session) a tiny checkpoint of a family and returns its directory."""
    built: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in built:
            built[family] = build_model(family, tmp_path_factory.mktemp(family), tokenizer_dir)
        return built[family]

    return make


@pytest.fixture(scope="session")
def llama_dir(model_factory) -> Path:
    return model_factory("llama")
