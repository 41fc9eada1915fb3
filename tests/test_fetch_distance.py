"""The native kernel's fetch distance for a few rows: any distance computes the same
bits, `tokenmill tune` stores the fastest per host and kernel build, and an engine on
the native kernel takes it (the build's where nothing is stored)."""

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
    before = native_linear.stream_ahead()
    try:
        results = []
        for distance in (0, 1, 16, 64, 1024):
            native_linear.set_stream_ahead(distance)
            results.append(native_linear.linear(x, packed, None, 96))
    finally:
        native_linear.set_stream_ahead(before)
    assert all(torch.equal(results[0], r) for r in results[1:])
    torch.testing.assert_close(results[0], x @ native_linear.unpack(packed, 96).T,
                               rtol=1e-4, atol=1e-4)
    for wrong in (-1, 1025):
        with pytest.raises(RuntimeError, match="stream ahead"):
            native_linear.set_stream_ahead(wrong)
    assert native_linear.stream_ahead() == before


@needs_native
def test_a_stored_distance_is_taken_by_the_engine_for_its_build_only(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch_distance, "CACHE", tmp_path)
    monkeypatch.setattr(table, "CACHE", tmp_path)
    monkeypatch.setenv("TOKENMILL_AUTO_TUNE", "1")
    built = native_linear.built_stream_ahead()
    before = native_linear.stream_ahead()
    try:
        assert fetch_distance.native_stream_ahead(2) == built  # nothing stored
        entry = fetch_distance.write(2, {16: 1.0, built: 2.0}, "test shape")
        assert entry["stream_ahead"] == 16
        assert fetch_distance.native_stream_ahead(2) == 16
        assert fetch_distance.native_stream_ahead(1) == built  # keyed by threads
        NativeProducts(torch.device("cpu")).configure_threads(2)
        assert native_linear.stream_ahead() == 16
        assert "-> 16 (build: " in fetch_distance.format_entry(entry)
        path = fetch_distance.table_path(2)
        path.write_text(path.read_text().replace(native_linear.build_name(), "older"))
        assert fetch_distance.native_stream_ahead(2) == built  # another build's: not taken
        for absurd in (5000, -1, 16.0, "16"):  # a hand-edited file: not taken either
            fetch_distance.write(2, {16: 1.0, built: 2.0}, "test shape")
            path.write_text(path.read_text().replace('"stream_ahead": 16',
                                                     f'"stream_ahead": {absurd!r}'.replace("'", '"')))
            assert fetch_distance.read(2) is None
            assert fetch_distance.native_stream_ahead(2) == built
        monkeypatch.setenv("TOKENMILL_AUTO_TUNE", "0")
        fetch_distance.write(2, {16: 1.0, built: 2.0}, "test shape")
        assert fetch_distance.native_stream_ahead(2) == built  # the suite's switch
    finally:
        native_linear.set_stream_ahead(before)


@needs_native
def test_the_measurement_times_every_candidate_and_restores_the_distance():
    before = native_linear.stream_ahead()
    seconds = fetch_distance.measure([(64, 256), (256, 64)], threads=1, copies=2, repeats=1)
    assert set(seconds) == set(fetch_distance.CANDIDATES) and min(seconds.values()) > 0
    assert native_linear.stream_ahead() == before
