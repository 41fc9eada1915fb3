"""When to speculate, and how far: per-request acceptance against measured costs,
guarded by a direct A/B of measured step throughput.

With per-token acceptance α and k drafts, a verification step emits on average
E(α, k) = (1 - α^(k+1)) / (1 - α) tokens (Leviathan et al. 2023). It costs one
request's share of a step, S, plus the verification of k more tokens (k b) and the
proposer's time (its share of a fixed per-call cost p0, plus k p1). The controller
picks the k in [0, K] with the best E / cost; k = 0 is plain decoding at 1 / S.

The right-hand side is measured while serving: running least-squares fits of
decode-step forward time against the rows the step computes (a + b rows, with
S = (a + b B) / B at B decoding requests; rows are tokens as the CPU products pad
them, e.g. 9-16 tokens alike) and of proposer time
against the tokens it drafted (p0 + p1 tokens). α is an exponentially decayed count
of accepted over verified draft positions per request, starting from an optimistic
prior so that the first requests get to try (later ones start from the acceptance
measured over all requests lately); requests that stopped speculating are probed
with one token each, all on the same step, every probe_interval steps so that they
can come back.

A cost model can be wrong (caches, thread pools, Python overhead that does not
scale like the fits assume), so a guard compares what matters directly: seconds
per emitted token of whole decode steps with and without speculation (one plain
step is forced every probe_interval steps to keep that figure fresh, every fourth
interval while speculation wins by 20% or more), kept per batch-size class (1, 2-3,
4-7, ...), since whether speculation pays depends on how many requests share a step.
When speculating does not measure at least 3% faster, nobody speculates (a near-tie
is within the timing noise, and speculating costs more than its steps show); after
a wait the guard retries: it forgets the speculative figure and speculates until it
has a fresh one (3 steps). A retry wins only at 6% faster (a small sample: a
proposer near break-even must not win one by noise). Each retry that still loses
doubles the wait (up to 64 intervals); one that wins resets it. The wait is also
long enough that a retry costs at most ~1% of the steps it is spread over, by the
loss last measured on each token a speculative step emits: a proposer whose steps
cost 3x a plain one per token is retried far less often than one that lost by a
few percent. Waits are counted in the class's own steps.

Learning that speculation loses costs speculative steps, so a class learns from
smaller ones: verifying drafts costs more, relative to a plain step, the more
requests share the step, while what a draft is worth does not change; where the
nearest smaller class has speculation off (measured losing, or presumed so itself),
a new class presumes the same and first tries after that class's wait. While speculation is off, a feature-level
proposer is not fed hidden states (see wants_features).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.config import SpecConfig
from tokenmill.core.request import Request
from tokenmill.speculative.costs import StepCostFit, expected_tokens
from tokenmill.speculative.guard import Guard

# Prior acceptance: 1.2 accepted of 2 tried (α = 0.6), and how fast evidence fades
# (per request, and over all requests).
PRIOR_ACCEPTED, PRIOR_TRIED, DECAY = 1.2, 2.0, 0.9
OVERALL_DECAY = 0.98
# While the guard keeps speculation off, a feature-level proposer (EAGLE) is not fed
# the target's hidden states, except for this many steps before a retry.
FEATURE_LEAD = 8


@dataclass
class RequestSpecState:
    accepted: float = PRIOR_ACCEPTED
    tried: float = PRIOR_TRIED

    @property
    def alpha(self) -> float:
        return self.accepted / self.tried


def _identity(rows: int) -> int:
    return rows


class SpecController:
    def __init__(self, config: SpecConfig,
                 padded_rows: Callable[[int], int] = _identity) -> None:
        # How many rows a step of n tokens computes (the CPU products pad row counts:
        # cpu_blas.onednn_rows / padded_rows); the fits are in these rows.
        self.padded_rows = padded_rows
        self.max_k = config.num_speculative_tokens
        self.adaptive = config.spec_adaptive
        self.probe_interval = config.spec_probe_interval
        self.states: dict[str, RequestSpecState] = {}
        # Acceptance over all requests (slowly decayed): a new request's starting point.
        self.overall = RequestSpecState(accepted=0.0, tried=0.0)
        self.fit = StepCostFit()
        self.propose_fit = StepCostFit()
        # One guard per batch-size class (1, 2-3, 4-7, 8-15, ...): whether speculation
        # pays depends on how many requests share a step, and a verdict learnt at one
        # size must not be unlearnt at another (a loss only carries over to larger
        # classes, as a presumption: see guard()).
        self.guards: dict[int, Guard] = {}

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def state(self, request_id: str) -> RequestSpecState:
        state = self.states.get(request_id)
        if state is None:
            state = self.states[request_id] = RequestSpecState()
            if self.overall.tried >= PRIOR_TRIED:
                # Start from what this proposer has been achieving lately, not from the
                # optimistic prior: a proposer that rarely agrees with the target
                # would otherwise be tried afresh (and paid for) on every new request.
                state.accepted = PRIOR_TRIED * self.overall.alpha
        return state

    # ---- measurements ---------------------------------------------------------------
    def record_forward(self, num_tokens: int, seconds: float) -> None:
        """A decode-only step's forward time (prefill chunks would skew the fit)."""
        self.fit.add(self.padded_rows(num_tokens), seconds)

    def record_propose(self, num_tokens: int, seconds: float) -> None:
        """One proposer call (including calls that found nothing to propose)."""
        self.propose_fit.add(num_tokens, seconds)

    def record_step(self, seconds: float, num_emitted: int, speculated: bool,
                    batch: int = 1) -> None:
        """A whole decode-only step of `batch` requests (propose to last emitted token)
        for the guard."""
        if num_emitted:
            self.guard(batch).record(seconds, num_emitted, speculated)

    @staticmethod
    def size_class(batch: int) -> int:
        return 1 << (max(batch, 1).bit_length() - 1)

    def guard(self, batch: int) -> Guard:
        size_class = self.size_class(batch)
        guard = self.guards.get(size_class)
        if guard is None:
            # Verification costs grow with the batch while a draft's worth does not:
            # where the nearest smaller class has speculation off, this one presumably
            # loses too; it starts off and first tries after that class's wait,
            # instead of paying the proposer's start-up to learn it.
            smaller = [c for c in self.guards if c < size_class]
            nearest = self.guards[max(smaller)] if smaller else None
            wait = nearest.interval if nearest is not None and nearest.losing else None
            guard = self.guards[size_class] = Guard(self.probe_interval, wait)
        return guard

    def speculation_losing(self, batch: int = 1) -> bool:
        return self.guard(batch).losing

    def wants_features(self, batch: int) -> bool:
        """Whether a step of `batch` requests should hand the target's hidden states to
        the proposer (EAGLE): not while the guard keeps speculation off there, which
        saves a copy per request per step; it resumes FEATURE_LEAD steps before the
        retry, and the head restarts on what it sees from then on."""
        guard = self.guards.get(self.size_class(batch))  # a lookup: plans create guards
        if not self.adaptive or guard is None or not (guard.losing and guard.backing_off):
            return True
        return guard.steps - guard.last_probe >= guard.interval - FEATURE_LEAD

    def record_verify(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        state = self.state(request_id)
        tried = num_accepted + (1 if num_accepted < num_drafted else 0)
        state.accepted = DECAY * state.accepted + num_accepted
        state.tried = DECAY * state.tried + tried
        overall = self.overall
        overall.accepted = OVERALL_DECAY * overall.accepted + num_accepted
        overall.tried = OVERALL_DECAY * overall.tried + tried

    # ---- the decision -----------------------------------------------------------------
    def plan(self, requests: list[Request], limits: list[int]) -> list[int]:
        """Tokens to propose per request (0: decode normally); limits cap each k."""
        if not self.adaptive:
            return [min(self.max_k, limit) for limit in limits]
        guard = self.guard(len(requests))
        guard.steps += 1
        phase = guard.steps % self.probe_interval
        warming = guard.plain_rate.per_token is None and guard.steps % 2 == 0
        if guard.steps % guard.refresh_interval() == 0 or warming:
            # Plain steps keep the guard's baseline fresh (every other step until it
            # has one, so a losing configuration is caught within a few steps).
            return [0] * len(requests)
        if not guard.allows(guard.steps):
            return [0] * len(requests)
        fit = self.fit.coefficients()
        if fit is None:
            return [min(self.max_k, limit) for limit in limits]
        a, b = fit
        batch = max(len(requests), 1)
        plain_rows = self.padded_rows(batch)
        share = (a + b * plain_rows) / batch  # one request's part of a plain step
        p0, p1 = self.propose_fit.coefficients() or (0.0, 0.0)
        fixed = p0 / batch  # the proposer call is shared by the batch
        # k drafts of one request: the rows they add to the step and their proposing.
        # Alone in the step, the rows are what the products compute (padding
        # included); in a batch, padding is shared, so k rows.
        extra = [b * (self.padded_rows(1 + k) - 1 if batch == 1 else k) + p1 * k
                 for k in range(self.max_k + 1)]
        # Requests that stopped speculating draft one token on the same step, once
        # per interval: a probe makes its whole step a verification step (every row
        # padded to the longest), so scattered probes would tax most steps.
        probing = phase == self.probe_interval // 2
        plan = []
        for request, limit in zip(requests, limits, strict=True):
            state = self.state(request.request_id)
            k = self._best_k(state.alpha, share, fixed, extra, min(self.max_k, limit))
            if k == 0 and limit > 0 and probing:
                k = 1
            plan.append(k)
        return plan

    @staticmethod
    def _best_k(alpha: float, share: float, fixed: float, extra: list[float],
                max_k: int) -> int:
        if share <= 0.0:
            return max_k
        best_k, best_rate = 0, 1.0 / share
        for k in range(1, max_k + 1):
            rate = expected_tokens(alpha, k) / (share + fixed + extra[k])
            if rate > best_rate * 1.02:  # a 2% margin against measurement noise
                best_k, best_rate = k, rate
        return best_k
