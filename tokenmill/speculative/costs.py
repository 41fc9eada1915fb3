"""What speculation is worth and costs, measured while serving: the expected tokens
of a verification at acceptance alpha, an exponentially weighted least-squares fit of
step time against the rows it computes, and a decayed seconds-per-token rate."""

from __future__ import annotations

# Until the fit sees steps of different sizes: one extra token costs 5% of a step.
PRIOR_TOKEN_COST = 0.05


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted by one verification of k drafts at acceptance alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class StepCostFit:
    """Exponentially weighted least squares of forward seconds = a + b * tokens."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.n = d * self.n + 1.0
        self.sx = d * self.sx + tokens
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + tokens * tokens
        self.sxy = d * self.sxy + tokens * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None before any step was seen."""
        if self.n == 0:
            return None
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        var_x = self.sxx / self.n - mean_x * mean_x
        if var_x < 0.25:  # all steps had (nearly) the same size: no slope yet
            b = PRIOR_TOKEN_COST * mean_y / max(mean_x, 1.0)
        else:
            b = max((self.sxy / self.n - mean_x * mean_y) / var_x, 0.0)
        a = max(mean_y - b * mean_x, 0.0)
        return a, b


class StepRate:
    """Exponentially weighted seconds per emitted token (and per step)."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.seconds = 0.0
        self.tokens = 0.0
        self.weight = 0.0  # decayed step count
        self.samples = 0

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds = self.decay * self.seconds + seconds
        self.tokens = self.decay * self.tokens + tokens
        self.weight = self.decay * self.weight + 1.0
        self.samples += 1

    @property
    def per_token(self) -> float | None:
        return self.seconds / self.tokens if self.samples >= 3 and self.tokens else None

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.weight if self.weight else 0.0
