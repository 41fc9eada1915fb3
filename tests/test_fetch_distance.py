"""The native kernel's fetch distances for a few rows (one for up to one_ahead_rows rows,
one for more): any distance computes the same bits, `tokenmill tune` stores the fastest
of each per host and kernel build, and an engine on the native kernel takes them (the
build's where nothing is stored)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers import fetch_distance, native_linear
from tokenmill.layers import product_table as table
from tokenmill.layers.products import NativeProducts

needs_native = pytest.mark.skipif(not native_linear.available(),
                                  reason="the native kernel cannot be built here")


def test_the_fastest_distance_wins_only_past_the_margin():
    assert fetch_distance.choose({0: 1.10, 16: 0.90, 64: 1.00}, built=64) == 16
    assert fetch_distance.choose({16: 0.99, 64: 1.00}, built=64) == 64  # within 2%
    assert fetch_distance.choose({16: 1.00, 32: 1.00, 64: 1.00}, built=64) == 64  # tie
    assert fetch_distance.choose({16: 0.50, 32: 0.50, 64: 1.00}, built=64) == 16  # stable
    assert fetch_distance.choose({16: 0.50}, built=64) == 16  # the build's not timed


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_every_distance_computes_the_same_bits(rows):
    generator = torch.Generator().manual_seed(0)
    packed = native_linear.pack(torch.randn(96, 700, generator=generator))
    x = torch.randn(rows, 700, generator=generator)
    before = native_linear.stream_ahead(rows)
    try:
        results = []
        for distance in (0, 1, 16, 64, 1024):
            native_linear.set_stream_ahead(distance, rows)
            assert native_linear.stream_ahead(rows) == distance
            results.append(native_linear.linear(x, packed, None, 96))
    finally:
        native_linear.set_stream_ahead(before, rows)
    assert all(torch.equal(results[0], r) for r in results[1:])
    torch.testing.assert_close(results[0], x @ native_linear.unpack(packed, 96).T,
                               rtol=1e-4, atol=1e-4)
    for wrong in (-1, 1025):
        with pytest.raises(RuntimeError, match="stream ahead"):
            native_linear.set_stream_ahead(wrong, rows)
    with pytest.raises(RuntimeError, match="rows"):
        native_linear.set_stream_ahead(16, 0)
    assert native_linear.stream_ahead(rows) == before


@needs_native
def test_one_row_and_several_rows_keep_their_own_distances():
    one, many = fetch_distance.ROWS, fetch_distance.MANY_ROWS
    assert one <= native_linear.one_ahead_rows() < many  # the tune times both classes
    before = (native_linear.stream_ahead(one), native_linear.stream_ahead(many))
    try:
        native_linear.set_stream_ahead(16, one)
        native_linear.set_stream_ahead(48, many)
        assert [native_linear.stream_ahead(r) for r in (1, native_linear.one_ahead_rows())] \
            == [16, 16]
        assert [native_linear.stream_ahead(r) for r in (native_linear.one_ahead_rows() + 1,
                                                        many, 12)] == [48, 48, 48]
    finally:
        native_linear.set_stream_ahead(before[0], one)
        native_linear.set_stream_ahead(before[1], many)


@needs_native
def test_a_stored_distance_is_taken_by_the_engine_for_its_build_only(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch_distance, "CACHE", tmp_path)
    monkeypatch.setattr(table, "CACHE", tmp_path)
    monkeypatch.setenv("TOKENMILL_AUTO_TUNE", "1")
    built = native_linear.built_stream_ahead()
    many = fetch_distance.MANY_ROWS
    before = (native_linear.stream_ahead(), native_linear.stream_ahead(many))
    try:
        assert fetch_distance.native_stream_ahead(2) == (built, built)  # nothing stored
        entry = fetch_distance.write(2, {16: 1.0, built: 2.0}, "test shape",
                                     {48: 1.0, 16: 2.0, built: 1.5})
        assert (entry["stream_ahead"], entry["stream_ahead_many"]) == (16, 48)
        assert fetch_distance.native_stream_ahead(2) == (16, 48)
        assert fetch_distance.native_stream_ahead(1) == (built, built)  # keyed by threads
        NativeProducts(torch.device("cpu")).configure_threads(2)
        assert (native_linear.stream_ahead(), native_linear.stream_ahead(many)) == (16, 48)
        shown = fetch_distance.format_entry(entry)
        assert "1 row," in shown and f"{many} rows," in shown and "-> 48 (build: " in shown
        # Only one row timed: the several-row class keeps the build's distance.
        entry = fetch_distance.write(2, {16: 1.0, built: 2.0}, "test shape")
        assert fetch_distance.native_stream_ahead(2) == (16, built)
        assert "not timed" in fetch_distance.format_entry(entry)
        path = fetch_distance.table_path(2)
        path.write_text(path.read_text().replace(native_linear.build_name(), "older"))
        assert fetch_distance.native_stream_ahead(2) == (built, built)  # another build's
        for key in ("stream_ahead", "stream_ahead_many"):
            for absurd in (5000, -1, 16.0, "16"):  # a hand-edited file: not taken either
                fetch_distance.write(2, {16: 1.0, built: 2.0}, "test shape",
                                     {16: 1.0, built: 2.0})
                path.write_text(path.read_text().replace(
                    f'"{key}": 16', f'"{key}": {absurd!r}'.replace("'", '"')))
                assert fetch_distance.read(2) is None
                assert fetch_distance.native_stream_ahead(2) == (built, built)
        monkeypatch.setenv("TOKENMILL_AUTO_TUNE", "0")
        fetch_distance.write(2, {16: 1.0, built: 2.0}, "test shape", {16: 1.0, built: 2.0})
        assert fetch_distance.native_stream_ahead(2) == (built, built)  # the suite's switch
    finally:
        native_linear.set_stream_ahead(before[0])
        native_linear.set_stream_ahead(before[1], many)


@needs_native
@pytest.mark.parametrize("rows", [fetch_distance.ROWS, fetch_distance.MANY_ROWS])
def test_the_measurement_times_every_candidate_and_restores_the_distance(rows):
    before = (native_linear.stream_ahead(), native_linear.stream_ahead(8))
    seconds = fetch_distance.measure([(64, 256), (256, 64)], threads=1, copies=2, repeats=1,
                                     rows=rows)
    assert set(seconds) == set(fetch_distance.CANDIDATES) and min(seconds.values()) > 0
    assert (native_linear.stream_ahead(), native_linear.stream_ahead(8)) == before
