"""The decode kernel's prefetch level (attention/kv_fetch.py): the choice on synthetic
timings, the kernel's setting (any level leaves every output bit unchanged), the
measurement stored once per host and kernel build and read back, and an engine taking
the stored level at start-up."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.attention import kv_fetch
from tokenmill.attention.paged_native import FLAGS, SOURCE, native_decode

KERNEL = native_decode()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the decode kernel cannot be built here")


def test_choose_takes_the_faster_level_only_past_the_margin():
    assert kv_fetch.choose({1: 1.0, 2: 0.9}, built=1) == 2
    assert kv_fetch.choose({1: 1.0, 2: 0.99}, built=1) == 1  # within 2%: the build's
    assert kv_fetch.choose({1: 1.0, 2: 1.0}, built=2) == 2  # a tie stays with the build's
    assert kv_fetch.choose({1: 0.5, 2: 1.0}, built=2) == 1


def test_measured_pools_are_whole_blocks_beyond_the_caches(monkeypatch):
    for kv_heads, head_dim in ((2, 64), (8, 128), (1, 16)):
        context = kv_fetch.context_for(kv_heads, head_dim)
        assert context % kv_fetch.BLOCK == 0 and context >= 4 * kv_fetch.BLOCK
        total = kv_fetch.LAYERS * kv_fetch.ROWS * context * 2 * kv_heads * head_dim * 4
        assert total >= kv_fetch.pool_bytes() >= kv_fetch.POOL_BYTES
    monkeypatch.setattr(kv_fetch, "last_level_cache_bytes", lambda: 2**30)  # a 1 GB L3
    assert kv_fetch.pool_bytes() == kv_fetch.MAX_POOL_BYTES


@pytest.fixture
def level_restored():
    before = KERNEL.fetch_level() if KERNEL is not None else None
    yield
    if KERNEL is not None:
        KERNEL.set_fetch_level(before)


@needs_kernel
def test_every_level_gives_the_same_bits(level_restored):
    generator = torch.Generator().manual_seed(0)
    blocks, block, kv_heads, head_dim = 40, 16, 2, 64
    keys = torch.randn(blocks, block, kv_heads, head_dim, generator=generator)
    values = torch.randn(blocks, block, kv_heads, head_dim, generator=generator)
    tables = torch.randperm(blocks, generator=generator).view(4, 10)
    lengths = torch.tensor([160, 37, 1, 99])
    q = torch.randn(4, 14, head_dim, generator=generator)
    outputs = []
    for level in (1, 2):
        KERNEL.set_fetch_level(level)
        assert KERNEL.fetch_level() == level
        outputs.append(KERNEL.paged_decode(q, keys, values, tables, lengths, 0.125))
    assert torch.equal(outputs[0], outputs[1])
    with pytest.raises(RuntimeError, match="fetch level must be 1"):
        KERNEL.set_fetch_level(3)


@needs_kernel
def test_configure_measures_once_then_reads(tmp_path, monkeypatch, level_restored):
    monkeypatch.setattr(kv_fetch, "CACHE", tmp_path)
    monkeypatch.setenv("TOKENMILL_AUTO_TUNE", "1")
    calls = []

    def timed(kernel, heads, kv_heads, head_dim):
        calls.append((heads, kv_heads, head_dim))
        return {1: 2.0, 2: 1.0}  # L2 twice as fast

    monkeypatch.setattr(kv_fetch, "measure", timed)
    assert kv_fetch.configure(KERNEL, SOURCE, FLAGS, 4, 2, 16) == 2
    assert KERNEL.fetch_level() == 2 and calls == [(4, 2, 16)]
    path = kv_fetch.table_path(SOURCE, FLAGS, 4, 2, 16, torch.get_num_threads())
    assert json.loads(path.read_text())["level"] == 2
    assert kv_fetch.configure(KERNEL, SOURCE, FLAGS, 4, 2, 16) == 2
    assert len(calls) == 1  # read back, not measured again
    # An entry another build of the kernel made (its own level differs) is measured again.
    entry = json.loads(path.read_text())
    path.write_text(json.dumps({**entry, "built": 3 - KERNEL.built_fetch_level()}))
    kv_fetch.configure(KERNEL, SOURCE, FLAGS, 4, 2, 16)
    assert len(calls) == 2
    # Another head geometry has its own entry; with auto-tuning off, the build's level.
    assert kv_fetch.configure(KERNEL, SOURCE, FLAGS, 8, 2, 16) == 2 and len(calls) == 3
    monkeypatch.setenv("TOKENMILL_AUTO_TUNE", "0")
    assert kv_fetch.configure(KERNEL, SOURCE, FLAGS, 4, 2, 16) == KERNEL.built_fetch_level()
    assert KERNEL.fetch_level() == KERNEL.built_fetch_level() and len(calls) == 3
    assert set(kv_fetch.stored(torch.get_num_threads())) == {path.stem, f"8-2-16-{path.stem[-8:]}"}
    # A file that does not read as an entry is measured again, and left out of the report.
    monkeypatch.setenv("TOKENMILL_AUTO_TUNE", "1")
    path.write_text('{"level": 2}')
    assert path.stem not in kv_fetch.stored(torch.get_num_threads())
    assert kv_fetch.configure(KERNEL, SOURCE, FLAGS, 4, 2, 16) == 2 and len(calls) == 4
    assert path.stem in kv_fetch.stored(torch.get_num_threads())


@needs_kernel
def test_the_engine_takes_the_stored_level(llama_dir, tmp_path, monkeypatch, level_restored):
    """A level stored for the model's head geometry is the kernel's after start-up, and
    generation matches the build's level token for token."""
    monkeypatch.setattr(kv_fetch, "CACHE", tmp_path)
    monkeypatch.setenv("TOKENMILL_AUTO_TUNE", "1")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 17, 42, 99, 3], list(range(20, 61))]
    texts = []
    for level in (2, 1):
        llm = LLM(str(llama_dir), cpu_blas="native", progress=False)
        spec = llm.engine.executor.worker.runner.backend.spec
        path = kv_fetch.table_path(SOURCE, FLAGS, spec.num_heads, spec.num_kv_heads,
                                   spec.head_dim, torch.get_num_threads())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"seconds": {"1": 1.0, "2": 1.0}, "threads": 2,
                                    "built": KERNEL.built_fetch_level(), "level": level}))
        llm = LLM(str(llama_dir), cpu_blas="native", progress=False)
        assert KERNEL.fetch_level() == level
        texts.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert texts[0] == texts[1]
