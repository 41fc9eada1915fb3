"""The compare report: a Markdown table with ratios to the baseline, and PNG plots.

Plots (matplotlib, Agg backend, no display needed):
- latency_cdf.png: CDFs of TTFT and TPOT per system, at the highest concurrency;
- throughput_vs_concurrency.png: output tokens/s per system at each concurrency;
- ttft_vs_tpot.png: one point per request, per system, at the highest concurrency.
"""

from __future__ import annotations

import collections
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.bench.metrics import RequestRecord, RunSummary, summarize


@dataclass
class SystemResult:
    """One system (an engine config or a peer) at one concurrency, over repetitions."""

    system: str
    concurrency: int | None  # None: all requests at once
    summaries: list[RunSummary] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    # Speculative decoding (tokenmill configs that use it): draft tokens verified, accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_acceptance(self) -> float | None:
        if not self.spec_draft_tokens:
            return None
        return self.spec_accepted_tokens / self.spec_draft_tokens

    @property
    def output_throughput(self) -> float:
        return statistics.median(s.output_throughput for s in self.summaries)

    @property
    def request_throughput(self) -> float:
        return statistics.median(s.request_throughput for s in self.summaries)

    @property
    def pooled(self) -> RunSummary:
        """Latency distributions over the requests of every repetition."""
        return summarize(self.records, sum(s.duration_s for s in self.summaries))

    def to_json(self) -> dict:
        return {"system": self.system, "concurrency": self.concurrency,
                "output_throughput_median": self.output_throughput,
                "request_throughput_median": self.request_throughput,
                "spec_acceptance": self.spec_acceptance,
                "repetitions": [s.to_json() for s in self.summaries],
                "pooled": self.pooled.to_json(), "errors": dict(self.errors())}

    def errors(self) -> collections.Counter[str]:
        """The failed requests' errors, with how many of them each ended with."""
        return collections.Counter(r.error or "unknown" for r in self.records if not r.success)


def _label(concurrency: int | None) -> str:
    return "all" if concurrency is None else str(concurrency)


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base and base == base else "n/a"


def markdown_table(results: Sequence[SystemResult], baseline: str) -> str:
    by_level: dict[int | None, list[SystemResult]] = {}
    for result in results:
        by_level.setdefault(result.concurrency, []).append(result)
    lines = []
    for level, group in by_level.items():
        base = next((r for r in group if r.system == baseline), group[0])
        base_tpot = base.pooled.tpot_ms.median
        lines += [f"### concurrency {_label(level)}", "",
                  "| system | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
                  "ITL p99 ms | E2E p50 ms | out tok/s vs "
                  f"{base.system} | TPOT vs {base.system} | draft acceptance |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in group:
            p = r.pooled
            lines.append(
                f"| {r.system} | {r.request_throughput:.2f} | {r.output_throughput:.1f} | "
                f"{p.ttft_ms.median:.1f} | {p.ttft_ms.p99:.1f} | {p.tpot_ms.median:.2f} | "
                f"{p.itl_ms.p99:.2f} | {p.e2e_ms.median:.1f} | "
                f"{_ratio(r.output_throughput, base.output_throughput)} | "
                f"{_ratio(p.tpot_ms.median, base_tpot)} | "
                f"{'-' if r.spec_acceptance is None else f'{r.spec_acceptance:.1%}'} |")
        lines += [f"- {name}: {WHOLE_STREAM_NOTE}" for name in whole_streams(group)]
        lines += failure_notes(group)
        lines.append("")
    return "\n".join(lines)


WHOLE_STREAM_NOTE = (
    "its streams arrived in one or two chunks each, so its TTFT, TPOT and ITL say when "
    "the text came, not the tokens (a server that sends no chunk for a token without "
    "text yet, on a model whose tokens mostly decode to none); its throughput counts "
    "every token")


def failure_notes(group: Sequence[SystemResult]) -> list[str]:
    """A line for each system with failed requests: how many, and why. Its throughput
    counts only the requests that completed, so its row is no fair comparison."""
    notes = []
    for result in group:
        errors = result.errors()
        if errors:
            why = "; ".join(f"{count} x {error[:160]}" for error, count in errors.most_common(3))
            notes.append(f"- **{result.system}: {sum(errors.values())} of {len(result.records)} "
                         f"requests failed** ({why}); its row counts only the completed "
                         "ones, so it compares nothing")
    return notes


def whole_streams(group: Sequence[SystemResult]) -> list[str]:
    """The systems whose requests' outputs (4 tokens or more, the median) came in at most
    two chunks, the median: their latency columns do not time tokens."""
    names = []
    for result in group:
        done = [r for r in result.records if r.success]
        if (done and statistics.median(r.output_tokens for r in done) >= 4
                and statistics.median(len(r.chunk_times) for r in done) <= 2):
            names.append(result.system)
    return names


def _cdf(ax, values: list[float], label: str) -> None:
    ordered = sorted(values)
    if ordered:
        ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post",
                label=label)


def plot_results(results: Sequence[SystemResult], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [r.concurrency for r in results]
    top = max(levels, key=lambda c: float("inf") if c is None else c)
    at_top = [r for r in results if r.concurrency == top]
    systems = list(dict.fromkeys(r.system for r in results))
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in at_top:
        done = [rec for rec in r.records if rec.success]
        _cdf(axes[0], [1000 * rec.ttft for rec in done], r.system)
        _cdf(axes[1], [1000 * rec.tpot for rec in done], r.system)
    for ax, name in zip(axes, ("TTFT", "TPOT"), strict=True):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF, concurrency {_label(top)}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "latency_cdf.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    numeric = sorted({c for c in levels if c is not None})
    positions = {c: i for i, c in enumerate(numeric + ([None] if None in levels else []))}
    for system in systems:
        points = sorted((positions[r.concurrency], r.output_throughput) for r in results
                         if r.system == system)
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=system)
    ax.set_xticks(list(positions.values()), [_label(c) for c in positions])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens / s (median)")
    ax.set_title("throughput vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "throughput_vs_concurrency.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for r in at_top:
        done = [rec for rec in r.records if rec.success]
        ax.scatter([1000 * rec.ttft for rec in done], [1000 * rec.tpot for rec in done],
                   s=14, alpha=0.7, label=r.system)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("TPOT (ms)")
    ax.set_title(f"per-request TTFT vs TPOT, concurrency {_label(top)}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "ttft_vs_tpot.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(results: Sequence[SystemResult], out_dir: Path, baseline: str,
                 header: dict[str, str], skipped: Sequence[str] = ()) -> Path:
    """report.md, results.json and the PNGs in out_dir; returns the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_results(results, out_dir)
    lines = ["# tokenmill bench compare", ""]
    lines += [f"- {key}: {value}" for key, value in header.items()]
    lines += [f"- skipped: {note}" for note in skipped]
    lines += ["", f"Ratios are against `{baseline}`, measured in the same run; throughput is "
              "the median over repetitions, latency percentiles pool every repetition's "
              "requests.", "", markdown_table(results, baseline), "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    (out_dir / "results.json").write_text(json.dumps(
        {"header": header, "baseline": baseline, "skipped": list(skipped),
         "results": [r.to_json() for r in results]}, indent=2))
    return report
