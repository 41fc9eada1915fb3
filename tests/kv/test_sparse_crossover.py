"""The sparse backends' self-check (attention/crossover.py): the crossover rule on
timing tables, the start-up measurement and its cache, and rows below the crossover
running dense beside sparse rows in one batch."""

from __future__ import annotations

import pytest

from tests.engine_run import run_staggered
from tokenmill import SamplingParams
from tokenmill.attention import crossover
from tokenmill.attention.crossover import NEVER, choose_crossover
from tokenmill.engine.engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [list(range(3, 90)), [5, 17, 42] * 20, list(range(100, 131))]


def test_the_crossover_is_where_sparse_wins_from_then_on():
    assert choose_crossover({256: (1, 2), 512: (2, 2), 1024: (4, 3), 2048: (8, 4)}) == 1024
    # A win followed by a loss does not count: sparse must win at every longer length.
    assert choose_crossover({256: (1, 0.5), 512: (2, 3), 1024: (4, 3)}) == 1024
    assert choose_crossover({256: (1, 2), 512: (2, 3)}) == NEVER
    assert choose_crossover({256: (1, 0.1), 512: (2, 0.2)}) == 256
    # Within the margin (5%) is not a win.
    assert choose_crossover({256: (1.0, 0.97)}) == NEVER


def test_the_crossover_is_measured_once_per_machine_and_cached(model_factory, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("TOKENMILL_AUTO_TUNE", "1")
    monkeypatch.setattr(crossover, "CACHE", tmp_path)
    monkeypatch.setattr(crossover, "MAX_PROBE", 1024)
    model_dir = model_factory("llama")
    options = dict(progress=False, attention_backend="quest", block_size=4,
                   sparse_dense_layers=1)
    engine = LLMEngine.from_kwargs(str(model_dir), **options)
    backend = engine.executor.worker.runner.backend
    files = list(tmp_path.rglob("*.json"))
    assert len(files) == 1 and backend.min_context > 0
    assert backend.queries == 0 and engine.kv_manager.num_free_blocks == \
        engine.kv_manager.num_blocks  # the probe leaves nothing behind

    def fail(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(crossover, "measure_table", fail)
    again = LLMEngine.from_kwargs(str(model_dir), **options)
    assert again.executor.worker.runner.backend.min_context == backend.min_context
    # The probe's random keys are overwritten by real requests: with a budget that
    # covers these contexts the engine still gives dense attention's tokens.
    dense = run_staggered(LLMEngine.from_kwargs(str(model_dir), progress=False,
                                                attention_backend="paged", block_size=4),
                          PROMPTS, GREEDY)
    assert run_staggered(again, PROMPTS, GREEDY) == dense


@pytest.mark.parametrize("backend", ["quest", "static-topk"])
def test_rows_below_the_crossover_run_dense_beside_sparse_rows(model_factory, backend):
    model_dir = model_factory("llama")

    def run(**options):
        engine = LLMEngine.from_kwargs(str(model_dir), progress=False, block_size=4,
                                       **options)
        return run_staggered(engine, PROMPTS, GREEDY), engine

    dense, _ = run(attention_backend="paged")
    options = dict(attention_backend=backend, sparse_budget=8, sparse_dense_layers=1)
    sparse, _ = run(sparse_min_context=0, **options)
    mixed, engine = run(sparse_min_context=70, **options)
    # Prompt 2 (31 + 24 tokens) never reaches 70: dense; prompt 0 (87+) always sparse.
    assert mixed[2] == dense[2]
    assert mixed[0] == sparse[0]
    assert sparse[0] != dense[0]  # (a budget of 8 does change this row)
    assert engine.executor.worker.runner.backend.queries > 0
