"""The guard: whether speculation measurably pays, per batch-size class, checked
against reality rather than the cost model.

It compares seconds per emitted token of whole decode steps with and without
speculation (see controller.py's docstring for the schedule of plain steps, retries
and the presumption a larger class takes from a smaller one)."""

from __future__ import annotations

import math

from tokenmill.speculative.costs import StepRate

# A guard retry measures this many speculative steps, and may cost this share of
# the steps between retries (in plain-step time, by the last measured loss).
RETRY_STEPS, RETRY_BUDGET = 3, 0.01
# The longest wait between retries, in probe intervals (of the batch-size class's
# own steps): a proposer whose steps cost many plain ones is still retried now and
# then, since the text it drafts for may have changed.
LONGEST_WAIT = 64
# Speculation stays on only while its steps measure at least this much faster per
# emitted token than plain ones: a near-tie is within the step-timing noise, and
# speculating has costs the step timings do not show (planning, proposer state).
GUARD_MARGIN = 0.03
# After speculation was measured losing, a retry turns it back on only when it
# measures this much faster: 3 steps are a small sample, and a proposer near
# break-even would otherwise win a retry now and then by noise alone, then lose
# for as long as its decayed figure takes to show it again.
RETRY_MARGIN = 0.06
# Where speculation measures at least this much faster per token, the plain steps
# that keep the baseline fresh come REFRESH_STRETCH times less often: a stale
# baseline can only make the guard more cautious (plain steps slow down as contexts
# grow), and each plain step forgoes most of a large gain.
CLEAR_WIN, REFRESH_STRETCH = 0.2, 4
class Guard:
    """Measured seconds per emitted token of plain and speculative decode steps (of
    one batch-size class), and the retry schedule while speculation loses. Steps are
    counted per class: a class that is rarely seen is not retried on each visit."""

    def __init__(self, probe_interval: int, presumed_losing_wait: int | None = None) -> None:
        self.probe_interval = probe_interval
        self.plain_rate = StepRate()
        self.spec_rate = StepRate()
        self.steps = 0  # plans made for this class
        self.last_probe = 0
        self.interval = probe_interval
        self.backing_off = False
        # Set when the nearest smaller batch-size class has speculation off: this one
        # starts off (waiting as long as that one does) without paying to learn it;
        # cleared by its first retry.
        self.presumed_losing = presumed_losing_wait is not None
        if presumed_losing_wait is not None:
            self.backing_off, self.interval = True, presumed_losing_wait

    def record(self, seconds: float, num_emitted: int, speculated: bool) -> None:
        (self.spec_rate if speculated else self.plain_rate).add(seconds, num_emitted)

    def refresh_interval(self) -> int:
        """Steps between the plain steps that keep the baseline fresh."""
        plain, spec = self.plain_rate.per_token, self.spec_rate.per_token
        if plain is not None and spec is not None and spec <= plain * (1.0 - CLEAR_WIN):
            return REFRESH_STRETCH * self.probe_interval
        return self.probe_interval

    @property
    def losing(self) -> bool:
        plain, spec = self.plain_rate.per_token, self.spec_rate.per_token
        if spec is None:
            return self.presumed_losing
        margin = RETRY_MARGIN if self.backing_off else GUARD_MARGIN
        return plain is not None and spec > plain * (1.0 - margin)

    def retry_wait(self) -> int:
        """Steps between retries for which a retry (RETRY_STEPS speculative steps at
        the last measured loss) costs RETRY_BUDGET of their time. A speculative step
        emits more tokens than a plain one, and its loss is on each of them."""
        plain, spec = self.plain_rate.per_token, self.spec_rate.per_token
        if plain is None or spec is None or plain <= 0.0:
            return self.probe_interval
        loss = spec / plain - (1.0 - GUARD_MARGIN)
        emitted = self.spec_rate.tokens_per_step / max(self.plain_rate.tokens_per_step, 1e-9)
        return math.ceil(RETRY_STEPS * max(loss, 0.0) * max(emitted, 1.0) / RETRY_BUDGET)

    def allows(self, step: int) -> bool:
        """Whether step `step` may speculate. While speculation loses: off; after a
        while, retry: forget the old verdict and measure speculation afresh for a few
        steps (the verdict may come from a stretch of text that did not speculate
        well, or from cold caches). The wait doubles while retries keep losing (a
        step of an expensive proposer costs several plain steps) and lets a retry
        cost at most RETRY_BUDGET at the loss last measured."""
        if not self.losing:
            if self.backing_off and self.spec_rate.per_token is not None:
                self.backing_off, self.interval = False, self.probe_interval  # won again
            return True
        longest = LONGEST_WAIT * self.probe_interval
        if not self.backing_off:
            self.backing_off, self.last_probe = True, step
            self.interval = min(max(self.interval, self.retry_wait()), longest)
        if step - self.last_probe < self.interval:
            return False
        self.last_probe = step
        self.interval = min(max(2 * self.interval, self.retry_wait()), longest)
        self.spec_rate = StepRate()
        self.presumed_losing = False
        return True
