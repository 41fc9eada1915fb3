"""Where the time went: model compute vs communication vs host overhead vs idle.

The wall time from the first step's start to the last step's end (less any
torch.profiler export pauses) is split exactly:
compute (forward and logits, less the collectives in them) + communication (the
tensor-parallel collectives and, with pipeline stages, the last stage's wait for the
previous one, as the worker timed them) + host overhead (schedule,
transfer to a worker process, input preparation, sampling, output) + idle (gaps
between steps). The four shares add up to 100%.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.profile.tracer import COMPUTE_PHASES, PHASES, StepRecord


@dataclass(frozen=True)
class TimeSummary:
    wall_s: float
    num_steps: int
    phase_s: dict[str, float] = field(default_factory=dict)  # per phase, plus "idle"
    compute_s: float = 0.0
    host_s: float = 0.0
    idle_s: float = 0.0
    communication_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0

    def share(self, seconds: float) -> float:
        return 100.0 * seconds / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def shares(self) -> dict[str, float]:
        """Percentages of the wall time: compute, communication, host and idle (they sum
        to 100)."""
        return {"compute": self.share(self.compute_s),
                "communication": self.share(self.communication_s),
                "host": self.share(self.host_s), "idle": self.share(self.idle_s)}

    def to_json(self) -> dict:
        return {"wall_s": self.wall_s, "num_steps": self.num_steps, "phase_s": self.phase_s,
                "compute_s": self.compute_s, "communication_s": self.communication_s,
                "host_s": self.host_s, "idle_s": self.idle_s,
                "shares_percent": self.shares, "prefill_tokens": self.prefill_tokens,
                "decode_tokens": self.decode_tokens}


def summarize_steps(steps: Sequence[StepRecord]) -> TimeSummary:
    if not steps:
        return TimeSummary(0.0, 0)
    phase_s = {name: 0.0 for name in PHASES}
    for step in steps:
        for name, start, end in step.phases:
            phase_s[name] = phase_s.get(name, 0.0) + (end - start)
    # Step starts and ends are phase boundaries, so the wall time splits exactly into
    # the phase sums and the gaps between steps.
    # (Time spent exporting a torch.profiler trace is neither: it is left out.)
    idle = sum(max(0.0, b.start - a.end - a.pause_after)
               for a, b in zip(steps, steps[1:], strict=False))
    phase_s["idle"] = idle
    communication = sum(s.communication_s for s in steps)
    compute = sum(s for name, s in phase_s.items() if name in COMPUTE_PHASES) - communication
    host = sum(s for name, s in phase_s.items() if name not in COMPUTE_PHASES and name != "idle")
    return TimeSummary(wall_s=compute + communication + host + idle, num_steps=len(steps),
                       phase_s=phase_s, compute_s=compute, host_s=host, idle_s=idle,
                       communication_s=communication,
                       prefill_tokens=sum(s.prefill_tokens for s in steps),
                       decode_tokens=sum(s.decode_tokens for s in steps))


def format_time_summary(summary: TimeSummary) -> str:
    lines = [f"{summary.num_steps} steps, {summary.wall_s * 1000:.1f} ms wall, "
             f"{summary.prefill_tokens} prefill + {summary.decode_tokens} decode tokens"]
    for name, seconds in summary.phase_s.items():
        lines.append(f"  {name:<15}{seconds * 1000:>10.1f} ms {summary.share(seconds):>6.1f}%")
    shares = summary.shares
    lines.append(f"compute {shares['compute']:.1f}% | communication "
                 f"{shares['communication']:.1f}% | host overhead {shares['host']:.1f}% | "
                 f"idle {shares['idle']:.1f}%")
    return "\n".join(lines)
