from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.models import build_model, build_thinking_tokenizer, build_tokenizer
from tokenmill.model.loader import load_model
from tokenmill.speculative.eagle.checkpoint import save_eagle_head
from tokenmill.speculative.eagle.head import EagleHead, head_arch

torch.set_num_threads(2)
# --cpu-blas auto takes the static rule in tests (workers inherit it): the same kernels
# on every run, whatever this host's measured table says (tests/test_product_table.py
# covers the measured path).
os.environ.setdefault("TOKENMILL_AUTO_TUNE", "0")


def pytest_sessionstart(session):
    """Compile (or load) the C++ kernels before any test runs: a fresh checkout builds
    them (~30 s each on two cores), which must not count against a test server's
    start-up timeout. A run capped at another instruction set (tests/test_isa.py runs a
    few tests so) builds only the kernels its tests use."""
    if os.environ.get("TOKENMILL_ISA"):
        return
    from tokenmill.attention.paged_native import native_decode
    from tokenmill.attention.retrieval import native_block_sparse
    from tokenmill.layers import native_linear
    from tokenmill.layers.native import native_row_ops
    from tokenmill.quant.kernels import a8_library, native_library

    for build in (native_row_ops, native_decode, native_block_sparse, native_library,
                  a8_library, native_linear.library):
        build()


@pytest.fixture(autouse=True)
def _kv_fetch_cache(tmp_path_factory, monkeypatch):
    """Engines started with auto-tuning on (a test's TOKENMILL_AUTO_TUNE=1) measure the
    decode kernel's prefetch level at start-up (attention/kv_fetch.py): kept in the test
    session's temporary folder, not the user's cache."""
    from tokenmill.attention import kv_fetch

    monkeypatch.setattr(kv_fetch, "CACHE", tmp_path_factory.getbasetemp() / "kv_fetch")


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


@pytest.fixture(scope="session")
def thinking_model_dir(tmp_path_factory) -> Path:
    """The tiny llama with a tokenizer that has `<think>` / `</think>` (as text tokens)
    and a generation_config.json that declares them: a (random) reasoning model."""
    tokenizer_path = tmp_path_factory.mktemp("thinking_tokenizer")
    build_thinking_tokenizer(tokenizer_path)
    path = build_model("llama", tmp_path_factory.mktemp("thinking_llama"), tokenizer_path)
    config_path = path / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["reasoning"] = {"start": "<think>", "end": "</think>"}
    config_path.write_text(json.dumps(config))
    return path


# Large enough that the random head's logits are far from ties.
TEST_INIT_STD = 0.2


@pytest.fixture(scope="session")
def eagle_head_dir(llama_dir, tmp_path_factory) -> Path:
    """A random-initialised EAGLE head for the tiny llama target."""
    target = load_model(llama_dir, dtype="float32", device="cpu", progress=False).model
    torch.manual_seed(0)
    head = EagleHead(head_arch(target.arch), target.model.rotary.max_positions)
    with torch.no_grad():
        for param in head.parameters():
            if param.dim() > 1:
                param.normal_(0.0, TEST_INIT_STD)
            else:
                param.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("eagle_head")
    save_eagle_head(head, path, {"name": "tiny-llama"})
    return path
