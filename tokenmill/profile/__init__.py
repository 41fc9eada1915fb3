"""Step tracing: per-phase timings of engine steps as Chrome/Perfetto traces."""

from tokenmill.profile.summary import TimeSummary, summarize_steps
from tokenmill.profile.tracer import PHASES, ProfileError, StepRecord, StepTracer

__all__ = ["PHASES", "ProfileError", "StepRecord", "StepTracer", "TimeSummary", "summarize_steps"]
