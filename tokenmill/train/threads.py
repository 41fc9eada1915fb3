"""Choosing the intra-op thread count from measured step times.

Training asks for 2 threads on this 2-core machine, but it runs at low priority
(``nice``) next to other work.  When another process holds one core, the second
training thread only gets the scraps of that core, and every parallel region
waits for it: a 2-thread step then takes several times longer than a 1-thread
step.  The chooser runs a probe step at the other thread count every
``probe_every`` steps and keeps whichever count has the lower recent time per
token, so training follows the machine's load.  Thread count changes only the
order of floating-point reductions, not the data or the schedule.
"""

from __future__ import annotations

import torch

SMOOTHING = 0.5


class ThreadChooser:
    """Alternates between thread counts by measured seconds per token."""

    def __init__(self, choices: tuple[int, ...] = (2, 1), probe_every: int = 25) -> None:
        if not choices or any(n < 1 for n in choices):
            raise ValueError(f"choices must be positive thread counts, got {choices}")
        if probe_every < 2:
            raise ValueError(f"probe_every must be >= 2, got {probe_every}")
        self.choices = choices
        self.probe_every = probe_every
        self.current = choices[0]
        self.seconds_per_token: dict[int, float] = {}
        self.steps_at: dict[int, int] = dict.fromkeys(choices, 0)
        self._active = self.current

    def threads_for_step(self, step: int) -> int:
        """Set and return the thread count for ``step``."""
        self._active = self.current
        if len(self.choices) > 1 and step % self.probe_every == self.probe_every - 1:
            others = [n for n in self.choices if n != self.current]
            self._active = others[(step // self.probe_every) % len(others)]
        torch.set_num_threads(self._active)
        return self._active

    def record(self, seconds: float, tokens: int) -> None:
        """Record the step just run and switch to the fastest count seen recently."""
        per_token = seconds / max(1, tokens)
        previous = self.seconds_per_token.get(self._active)
        self.seconds_per_token[self._active] = (
            per_token if previous is None else SMOOTHING * previous + (1 - SMOOTHING) * per_token
        )
        self.steps_at[self._active] += 1
        self.current = min(self.seconds_per_token, key=self.seconds_per_token.__getitem__)
