"""Latency and throughput metrics of a benchmark run, as pure functions.

A run produces one RequestRecord per request: when it was sent, when each chunk of
output arrived and how many tokens it carried. Everything else is computed here:

- TTFT  = first output chunk - send time
- TPOT  = (last chunk - first chunk) / (output tokens - 1)   (0 for one token)
- ITL   = gaps between consecutive output chunks (a chunk may carry several tokens)
- E2E   = end - send time
- goodput = share of requests that succeeded and met both the TTFT and TPOT SLOs.

All times are seconds on one monotonic clock; summaries report milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    request_id: str
    prompt_tokens: int
    start_time: float
    # Arrival time of each output chunk, in order; tokens carried by each chunk.
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end_time: float | None = None
    success: bool = True
    error: str | None = None
    # Output tokens as reported by the server/engine (None: the sum of chunk_tokens).
    reported_output_tokens: int | None = None

    @property
    def output_tokens(self) -> int:
        if self.reported_output_tokens is not None:
            return self.reported_output_tokens
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start_time if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        if not self.chunk_times:
            return None
        if self.output_tokens < 2:
            return 0.0
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def e2e(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.start_time

    def to_json(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q!r}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency, in milliseconds."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        ms = [v * 1000.0 for v in values]
        if not ms:
            return cls(0, *([math.nan] * 6))
        return cls(len(ms), sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 90),
                   percentile(ms, 99), min(ms), max(ms))


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in seconds; None means no limit on that metric."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.success or record.ttft is None:
            return False
        if self.ttft_s is not None and record.ttft > self.ttft_s:
            return False
        return self.tpot_s is None or record.tpot <= self.tpot_s


NO_SLO = SLO()


@dataclass(frozen=True)
class RunSummary:
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    input_throughput: float  # prompt tokens of completed requests / s
    output_throughput: float  # output tokens / s
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    goodput_share: float  # of all requests, the share meeting the SLO
    goodput_rps: float  # such requests per second
    slo: SLO

    def to_json(self) -> dict:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO = NO_SLO
              ) -> RunSummary:
    """Aggregate a run; throughputs count completed requests over the run's wall time."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    done = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    good = sum(1 for r in records if slo.met_by(r))
    return RunSummary(
        num_requests=len(records), completed=len(done), failed=len(records) - len(done),
        duration_s=duration_s, input_tokens=input_tokens, output_tokens=output_tokens,
        request_throughput=len(done) / duration_s,
        input_throughput=input_tokens / duration_s,
        output_throughput=output_tokens / duration_s,
        ttft_ms=Distribution.of_seconds([r.ttft for r in done if r.ttft is not None]),
        tpot_ms=Distribution.of_seconds([r.tpot for r in done if r.tpot is not None]),
        itl_ms=Distribution.of_seconds([gap for r in done for gap in r.itl]),
        e2e_ms=Distribution.of_seconds([r.e2e for r in done if r.e2e is not None]),
        goodput_share=good / len(records) if records else math.nan,
        goodput_rps=good / duration_s, slo=slo)


def format_summary(summary: RunSummary, title: str = "") -> str:
    """A short plain-text table of a summary, for the terminal."""
    lines = [title] if title else []
    lines.append(f"requests: {summary.completed} completed, {summary.failed} failed, "
                 f"{summary.duration_s:.2f} s")
    lines.append(f"throughput: {summary.request_throughput:.2f} req/s, "
                 f"{summary.input_throughput:.1f} input tok/s, "
                 f"{summary.output_throughput:.1f} output tok/s")
    lines.append(f"{'ms':<6}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        dist: Distribution = getattr(summary, name)
        lines.append(f"{name[:-3].upper():<6}{dist.mean:>10.1f}{dist.median:>10.1f}"
                     f"{dist.p90:>10.1f}{dist.p99:>10.1f}")
    slo = summary.slo
    if slo.ttft_s is not None or slo.tpot_s is not None:
        lines.append(f"goodput (TTFT <= {slo.ttft_s} s, TPOT <= {slo.tpot_s} s): "
                     f"{100 * summary.goodput_share:.1f}% of requests, "
                     f"{summary.goodput_rps:.2f} req/s")
    return "\n".join(lines)
