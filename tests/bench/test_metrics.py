"""Metric definitions checked against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from tokenmill.bench.metrics import SLO, Distribution, RequestRecord, percentile, summarize


def record(start, chunks, end=None, prompt=10, tokens=None, success=True, rid="r"):
    times = list(chunks)
    return RequestRecord(rid, prompt, start, times, tokens or [1] * len(times),
                         end if end is not None else (times[-1] if times else start),
                         success)


def test_ttft_tpot_itl_e2e_of_one_streamed_request():
    # sent at 1.0; tokens at 1.5, 1.7, 2.0, 2.1; done at 2.2
    r = record(1.0, [1.5, 1.7, 2.0, 2.1], end=2.2)
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx((2.1 - 1.5) / 3)  # 0.2
    assert r.itl == pytest.approx([0.2, 0.3, 0.1])
    assert r.e2e == pytest.approx(1.2)
    assert r.output_tokens == 4


def test_multi_token_chunks_count_tokens_but_one_gap_per_chunk():
    r = record(0.0, [1.0, 2.0], tokens=[1, 4])  # 5 tokens, second chunk carries 4
    assert r.output_tokens == 5
    assert r.tpot == pytest.approx(1.0 / 4)
    assert r.itl == pytest.approx([1.0])


def test_single_token_request_has_zero_tpot_and_no_itl():
    r = record(0.0, [0.3])
    assert r.tpot == 0.0
    assert r.itl == []


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]  # sorted 1 2 3 4
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7 -> 3 + 0.7
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_distribution_reports_milliseconds():
    dist = Distribution.of_seconds([0.001, 0.002, 0.003])
    assert dist.mean == pytest.approx(2.0)
    assert dist.median == pytest.approx(2.0)
    assert dist.min == pytest.approx(1.0) and dist.max == pytest.approx(3.0)
    assert dist.count == 3


def test_summary_throughputs_and_goodput():
    fast = record(0.0, [0.1, 0.2, 0.3], prompt=8, rid="fast")  # ttft .1, tpot .1
    slow_start = record(0.0, [0.9, 1.0], prompt=8, rid="slow")  # ttft .9, tpot .1
    slow_tokens = record(0.0, [0.1, 1.1], prompt=8, rid="gappy")  # ttft .1, tpot 1.0
    failed = record(0.0, [], prompt=8, success=False, rid="failed")
    summary = summarize([fast, slow_start, slow_tokens, failed], duration_s=2.0,
                        slo=SLO(ttft_s=0.5, tpot_s=0.5))
    assert (summary.completed, summary.failed) == (3, 1)
    assert summary.request_throughput == pytest.approx(1.5)
    assert summary.input_tokens == 24 and summary.input_throughput == pytest.approx(12.0)
    assert summary.output_tokens == 7 and summary.output_throughput == pytest.approx(3.5)
    # only "fast" meets both SLOs; the failed request counts against goodput
    assert summary.goodput_share == pytest.approx(0.25)
    assert summary.goodput_rps == pytest.approx(0.5)
    assert summary.ttft_ms.median == pytest.approx(100.0)
    # ITL gaps: .1 .1 | .1 | 1.0 -> mean .325 s
    assert summary.itl_ms.mean == pytest.approx(325.0)


def test_no_slo_means_every_success_is_good():
    summary = summarize([record(0.0, [5.0, 9.0])], duration_s=10.0)
    assert summary.goodput_share == 1.0


def test_reported_output_tokens_override_chunk_count():
    r = record(0.0, [1.0, 2.0])
    r.reported_output_tokens = 3
    assert r.output_tokens == 3 and r.tpot == pytest.approx(0.5)


def test_duration_must_be_positive():
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], 0.0)
