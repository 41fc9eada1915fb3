"""Step tracing: per-phase timings of engine steps as Chrome/Perfetto traces."""

from tokenmill.profile.summary import TimeSummary, summarize_steps
from tokenmill.profile.tracer import PHASES, StepRecord, StepTracer

__all__ = ["PHASES", "StepRecord", "StepTracer", "TimeSummary", "summarize_steps"]
