"""Tokens routed to each expert of each MoE layer: totals since start-up and over a
sliding time window, and the imbalance a step pays for (torch-free).

The imbalance of a layer is its busiest expert's tokens over the mean expert's
(max / mean; 1.0 = perfectly balanced). Under expert parallelism a step waits for
the rank with the hottest experts, so it is the slowdown a layer's routing imposes
over perfect balance (the "trailing effect").
"""

from __future__ import annotations

from collections import deque


def imbalance(counts: list[int]) -> float:
    """max / mean of one layer's per-expert tokens (1.0 when no token was routed)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 1.0


class ExpertLoad:
    def __init__(self, window_s: float = 10.0) -> None:
        if window_s < 0:
            raise ValueError(f"expert_stats_window_s must be >= 0, got {window_s!r}")
        self.window_s = window_s
        self.totals: list[list[int]] = []
        self._recent: deque[tuple[float, list[list[int]]]] = deque()

    def record(self, counts: list[list[int]], now: float) -> None:
        """One step's tokens per layer per expert, at monotonic time `now`."""
        if not self.totals:
            self.totals = [[0] * len(layer) for layer in counts]
        for total, layer in zip(self.totals, counts, strict=True):
            for expert, tokens in enumerate(layer):
                total[expert] += tokens
        self._recent.append((now, counts))
        self._expire(now)

    def window(self, now: float) -> list[list[int]]:
        """Tokens per layer per expert routed in the last window_s seconds."""
        self._expire(now)
        summed = [[0] * len(layer) for layer in self.totals]
        for _, counts in self._recent:
            for total, layer in zip(summed, counts, strict=True):
                for expert, tokens in enumerate(layer):
                    total[expert] += tokens
        return summed

    def imbalance(self, now: float) -> list[float]:
        """Each layer's max / mean over the window."""
        return [imbalance(layer) for layer in self.window(now)]

    def _expire(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
