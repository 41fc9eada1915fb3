"""`--cpu-blas auto` by measurement: the choice rule, the start-up probe stored once per
host and read after, and `tokenmill tune` on a model's own shapes."""

from __future__ import annotations

import pytest
import torch

import tokenmill.attention.prefill_native as prefill_native
import tokenmill.layers.product_table as table
from tokenmill.attention import kv_fetch
from tokenmill.cli import main
from tokenmill.layers import fetch_distance, native_linear
from tokenmill.layers.products import (
    NativeProducts,
    NumpyProducts,
    ProductPolicy,
    product_policy,
)


@pytest.fixture(autouse=True)
def _decode_rows_restored():
    """`tokenmill tune` and the policy set the kernel's decode-tile limit for the
    process: each test leaves it as it found it."""
    before = native_linear.decode_rows() if native_linear.available() else None
    yield
    if before is not None:
        native_linear.set_decode_rows(before)


def test_the_choice_is_the_smallest_geometric_mean_slowdown():
    seconds = {"a": {1: 1.0, 32: 4.0}, "b": {1: 2.0, 32: 1.0}, "c": {1: 1.5, 32: 2.5}}
    # Slowdowns: a 1 x 4 = 4, b 2 x 1 = 2, c 1.5 x 2.5 = 3.75.
    assert table.choose(seconds) == "b"
    assert table.choose({"a": {1: 1.0}, "b": {1: 1.1}}) == "a"


def test_every_candidate_is_timed_at_every_row_count():
    seconds = table.measure([(64, 32), (32, 64)], (1, 8), threads=1, repeats=1)
    assert set(seconds) == set(table.available_candidates())
    assert all(set(times) == {1, 8} and min(times.values()) > 0 for times in seconds.values())


def test_copies_put_a_passs_weights_beyond_the_last_level_cache(monkeypatch):
    monkeypatch.setattr(table, "last_level_cache_bytes", lambda: 32 * 2**20)
    monkeypatch.setattr(table, "host_available_memory", lambda: 2**34)
    assert table.cold_copies(10 * 2**20, most=24) == 7  # 70 MB >= twice the 32 MB
    assert table.cold_copies(10 * 2**20, most=3) == 3  # a model has no more layers
    assert table.cold_copies(100 * 2**20, most=24) == 1  # one pass is beyond it already
    # Four weight forms of every copy within half the memory available.
    monkeypatch.setattr(table, "host_available_memory", lambda: 200 * 2**20)
    assert table.cold_copies(10 * 2**20, most=24) == 2


def test_a_pass_goes_through_every_copy_and_counts_one(monkeypatch):
    weights = []

    def product_function(candidate, weight):
        weights.append(weight)
        return lambda x: None

    def one_pass(functions, xs):
        assert len(functions) == len(xs) == 6  # 3 copies x 2 shapes
        return 0.003 * len(xs)

    monkeypatch.setattr(table, "product_function", product_function)
    monkeypatch.setattr(table, "one_pass", one_pass)
    seconds = table.measure([(16, 8), (8, 16)], (1,), threads=1, repeats=1,
                            candidates=["torch"], copies=3)
    assert seconds["torch"][1] == pytest.approx(0.006)  # one pass of the two shapes
    assert len({w.data_ptr() for w in weights}) == 6  # every copy its own memory
    assert all(torch.equal(weights[i], weights[i % 2]) for i in range(6))


def test_a_cell_slower_than_more_rows_is_measured_again(monkeypatch):
    assert table.implausible({"a": {1: 1.0, 8: 5.0, 32: 2.0}, "b": {1: 1.0, 8: 1.0}}) == [
        ("a", 8)]
    # A burst during every pass of one cell: measured again, the cell is believed.
    calls = []

    def one_pass(functions, xs):
        calls.append(xs[0].shape[0])
        burst = xs[0].shape[0] == 8 and calls.count(8) <= 2  # warm-up and first pass
        return 1.0 if burst else 0.001 * xs[0].shape[0]

    monkeypatch.setattr(table, "one_pass", one_pass)
    seconds = table.measure([(16, 16)], (1, 8, 32), threads=1, repeats=1,
                            candidates=["torch"])
    assert seconds["torch"] == {1: 0.001, 8: 0.008, 32: 0.032}


def test_a_library_whose_threads_spin_is_left_to_settle_before_the_next_timing(monkeypatch):
    # OpenBLAS's workers spin after its calls: a candidate timed right after them ran on
    # one core (the native kernel at 2x its cost on a Zen 5 host, and the probe chose
    # oneDNN on it). Every timing after a spinning library's comes after a rest.
    events = []
    monkeypatch.setattr(table, "one_pass", lambda functions, xs: events.append("pass") or 1e-3)
    monkeypatch.setattr(table.time, "sleep", lambda s: events.append(("sleep", s)))
    table.measure([(16, 16)], (1, 8), threads=1, repeats=2, candidates=["numpy", "torch"])
    # Per row count: numpy's warm-up and 2 passes, the rest, then torch's 3 passes.
    per_rows = ["pass"] * 3 + [("sleep", table.SETTLE_S)] + ["pass"] * 3
    assert events == per_rows * 2
    assert table.SPINNING == {"numpy"} and table.SETTLE_S >= 0.1


def test_the_probe_runs_once_and_auto_follows_it(tmp_path, monkeypatch):
    monkeypatch.setattr(table, "CACHE", tmp_path)
    monkeypatch.setenv("TOKENMILL_AUTO_TUNE", "1")
    probes = []

    def fake_measure(shapes, rows, threads, repeats=5, **_):
        probes.append(threads)
        return {c: dict.fromkeys(rows, 1.0 if c == "numpy" else 2.0)
                for c in table.available_candidates()}

    monkeypatch.setattr(table, "measure", fake_measure)
    cpu = torch.device("cpu")
    assert isinstance(product_policy("auto", cpu, torch.float32), NumpyProducts)
    assert isinstance(product_policy("auto", cpu, torch.float32), NumpyProducts)
    assert len(probes) == 1  # stored for this host and thread count, then read
    assert table.read_table(torch.get_num_threads())["source"] == "probe"
    # A measured "torch" is torch's own products; explicit settings are not overridden.
    measured = dict.fromkeys(table.available_candidates(), {"1": 1.0})
    table.write_table(torch.get_num_threads(), {"choice": "torch", "threads": 2,
                                                "source": "tune", "seconds": measured})
    assert type(product_policy("auto", cpu, torch.float32)) is ProductPolicy
    assert isinstance(product_policy("numpy", cpu, torch.float32), NumpyProducts)
    assert len(probes) == 1
    # A table stored before a candidate existed (here: without "native") is measured
    # again, so a new kernel is never left out of the choice on hosts tuned earlier.
    del measured["native"]
    table.write_table(torch.get_num_threads(), {"choice": "torch", "threads": 2,
                                                "source": "tune", "seconds": measured})
    assert isinstance(product_policy("auto", cpu, torch.float32), NumpyProducts)
    assert len(probes) == 2 and table.read_table(torch.get_num_threads())["source"] == "probe"
    # The test suite's switch: the static rule, nothing measured or read.
    monkeypatch.setenv("TOKENMILL_AUTO_TUNE", "0")
    assert table.auto_choice() == table.static_choice()


def test_tune_measures_a_models_shapes_and_reports(tmp_path, monkeypatch, capsys, llama_dir):
    monkeypatch.setattr(table, "CACHE", tmp_path)
    monkeypatch.setattr(prefill_native, "CACHE", tmp_path)  # nor the prefill kernel's limit
    monkeypatch.setattr(fetch_distance, "CACHE", tmp_path)  # nor the fetch distance
    monkeypatch.setattr(kv_fetch, "CACHE", tmp_path)  # nor the attention's prefetch level
    assert main(["tune", "--report", "--threads", "1"]) == 1  # nothing measured yet
    assert main(["tune", "--model", str(llama_dir), "--rows", "1,4", "--repeats", "1",
                 "--threads", "1", "--out", str(tmp_path / "plot")]) == 0
    out = capsys.readouterr().out
    assert "| rows |" in out and "auto takes" in out
    stored = table.read_table(1)
    assert stored["source"] == "tune" and stored["choice"] in table.CANDIDATES
    assert (tmp_path / "plot" / "tune.png").stat().st_size > 0
    tiles = table.read_decode_tiles(1)
    if native_linear.available() and native_linear.max_decode_rows() > 0:
        assert tiles["source"] == "tune" and "native decode tiles (tune, 8 rows)" in out
    fetch = fetch_distance.read(1)
    if native_linear.available():
        assert fetch["stream_ahead"] in fetch_distance.CANDIDATES
        assert fetch["stream_ahead_many"] in fetch_distance.CANDIDATES
        assert "native fetch distance (tune, 1 row" in out
        assert f"native fetch distance (tune, {fetch_distance.MANY_ROWS} rows" in out
    assert main(["tune", "--report", "--threads", "1"]) == 0
    report = capsys.readouterr().out
    assert f"choice (smallest geometric-mean slowdown): {stored['choice']}" in report
    if tiles is not None:
        assert "native decode tiles (tune, 8 rows)" in report
    if fetch is not None:
        assert "native fetch distance (tune, 1 row" in report
    assert main(["tune", "--rows", "0,4"]) == 2
    assert main(["tune", "--model", str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize("candidate", table.available_candidates())
def test_each_candidate_computes_the_product(candidate):
    weight = torch.randn(48, 32)
    x = torch.randn(5, 32)
    with table.candidate_threads(1):
        result = table.product_function(candidate, weight)(x)
    torch.testing.assert_close(result, x @ weight.t(), rtol=1e-4, atol=1e-4)


def test_a_table_is_keyed_by_cpu_torch_and_threads(monkeypatch):
    base = table.table_path(2)
    assert table.table_path(1) != base  # another thread count
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert table.table_path(2) != base  # another torch: measured again
    monkeypatch.undo()
    monkeypatch.setattr(table, "cpu_signature", lambda: "another CPU|flags avx2")
    assert table.table_path(2) != base
    # Ties keep the candidates' order (oneDNN first): the same table, the same choice.
    assert table.choose({"onednn": {1: 1.0}, "numpy": {1: 1.0}}) == "onednn"


def test_the_wide_tile_is_taken_only_when_measured_faster():
    assert table.choose_decode_rows({12: 1.0, 0: 0.9}) == 0
    assert table.choose_decode_rows({12: 1.0, 0: 0.98}) == 12  # within 3%: the build's
    assert table.choose_decode_rows({12: 0.9, 0: 1.0}) == 12


@pytest.mark.skipif(not native_linear.available() or native_linear.max_decode_rows() == 0,
                    reason="needs the native kernel with decode tiles")
def test_the_decode_tiles_are_probed_once_per_host_and_set_by_the_policy(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(table, "CACHE", tmp_path)
    monkeypatch.setenv("TOKENMILL_AUTO_TUNE", "1")
    limit = native_linear.max_decode_rows()
    probes = []

    def fake_measure(shapes, threads, repeats=7):
        probes.append(threads)
        return {limit: 2.0, 0: 1.0}  # the wide tile twice as fast on this "host"

    monkeypatch.setattr(table, "measure_decode_tiles", fake_measure)
    before = native_linear.decode_rows()
    try:
        NativeProducts(torch.device("cpu")).configure_threads(2)
        assert native_linear.decode_rows() == 0 and probes == [2]
        assert table.native_decode_rows(2) == 0 and probes == [2]  # stored, then read
        assert table.read_decode_tiles(2)["source"] == "probe"
        assert table.native_decode_rows(1) == 0 and probes == [2, 1]  # keyed by threads
        # Measured by another build of the kernel: measured again.
        path = table.decode_tiles_path(2)
        path.write_text(path.read_text().replace(native_linear.build_name(), "older"))
        assert table.native_decode_rows(2) == 0 and probes == [2, 1, 2]
        monkeypatch.setenv("TOKENMILL_AUTO_TUNE", "0")  # the suite's switch: the build's
        assert table.native_decode_rows(2) == limit
        # The real measurement: both settings timed.
        monkeypatch.undo()
        native_linear.set_decode_rows(limit)
        seconds = table.measure_decode_tiles([(512, 64), (64, 512)], threads=1, repeats=1)
        assert set(seconds) == {limit, 0} and min(seconds.values()) > 0
        assert native_linear.decode_rows() == limit  # left as it was
    finally:
        native_linear.set_decode_rows(before)
