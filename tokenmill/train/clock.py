"""Where a run is in its schedule: training progress and the learning rate.

Progress runs from 0 to 1 over the run and drives the cosine decay.  Without a
wall-clock budget it is simply ``step / total_steps``, so a run is a pure function
of its seed and step counts.  With a budget (``max_seconds``) the machine may be
shared and slower than planned, so progress through the main phases is the larger
of the step fraction and the time fraction; the main phases stop when either
runs out, and the final long-context phase then always runs its full step count,
taking progress the rest of the way to 1.  The LR still ends at its floor, and
the log records the steps actually taken.
"""

from __future__ import annotations

import math
import time

from tokenmill.train.presets import Schedule

# Share of the budget for the main phases; the rest is kept for the final phase.
MAIN_PHASES_SHARE = 0.9


def learning_rate(step: int, progress: float, schedule: Schedule) -> float:
    """Linear warmup over the first steps, times cosine decay from peak to the floor."""
    warmup = min(1.0, (step + 1) / schedule.warmup_steps) if schedule.warmup_steps else 1.0
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    floor = schedule.min_lr_ratio
    return schedule.peak_lr * warmup * (floor + (1.0 - floor) * cosine)


class TrainingClock:
    """Tracks progress through a schedule, optionally against a wall-clock budget."""

    def __init__(self, schedule: Schedule, max_seconds: float | None = None) -> None:
        if max_seconds is not None and max_seconds <= 0:
            raise ValueError(f"max_seconds must be > 0, got {max_seconds}")
        self.schedule = schedule
        self.max_seconds = max_seconds
        phases = schedule.phases
        self.final_phase_index = len(phases) - 1 if len(phases) > 1 else None
        main_steps = sum(p.steps for i, p in enumerate(phases) if i != self.final_phase_index)
        self.main_end = main_steps / max(1, schedule.total_steps)
        self.started = time.perf_counter()
        self.final_start_progress = self.main_end

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def is_final_phase(self, phase_index: int) -> bool:
        return phase_index == self.final_phase_index

    def main_budget_spent(self) -> bool:
        """Whether the main phases must stop to leave time for the final phase."""
        if self.max_seconds is None:
            return False
        share = MAIN_PHASES_SHARE if self.final_phase_index is not None else 1.0
        return self.elapsed() >= self.max_seconds * share

    def progress(self, step: int, phase_index: int, step_in_phase: int) -> float:
        """Fraction of the run done before ``step`` (global) / ``step_in_phase``."""
        total = max(1, self.schedule.total_steps)
        if self.is_final_phase(phase_index):
            final_steps = max(1, self.schedule.phases[phase_index].steps)
            start = self.final_start_progress
            return start + (1.0 - start) * step_in_phase / final_steps
        by_steps = step / total
        if self.max_seconds is None:
            return by_steps
        share = MAIN_PHASES_SHARE if self.final_phase_index is not None else 1.0
        by_time = self.main_end * self.elapsed() / (self.max_seconds * share)
        return min(self.main_end, max(by_steps, by_time))

    def enter_final_phase(self, progress_so_far: float) -> None:
        """Record where the main phases ended so the final phase finishes the decay."""
        self.final_start_progress = progress_so_far
