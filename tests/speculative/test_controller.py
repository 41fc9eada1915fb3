"""The adaptive switch: speculate as far as pays, stop when it does not, probe to resume."""

from __future__ import annotations

import pytest

from tokenmill.config import SpecConfig
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.speculative.controller import SpecController
from tokenmill.speculative.costs import StepCostFit, expected_tokens
from tokenmill.speculative.guard import LONGEST_WAIT


def request(name: str) -> Request:
    return Request(name, [1, 2, 3], SamplingParams(temperature=0), 0.0, 100)


def test_expected_tokens_formula():
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)  # 3.36
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0


def test_cost_fit_recovers_a_line():
    fit = StepCostFit()
    for tokens in (1, 5, 1, 9, 3, 5, 1):
        fit.add(tokens, 0.002 + 0.0005 * tokens)
    a, b = fit.coefficients()
    assert a == pytest.approx(0.002, rel=1e-6)
    assert b == pytest.approx(0.0005, rel=1e-6)


def feed(controller: SpecController, a: float, b: float, draft_cost: float) -> None:
    for tokens in (1, 5, 3, 1, 5):
        controller.record_forward(tokens, a + b * tokens)
    for drafted in (4, 8, 12):
        controller.record_propose(drafted, drafted * draft_cost)
    for _ in range(3):  # whole steps measured so far: speculation is not losing
        controller.record_step(a + b, 1, speculated=False)
        controller.record_step(a + 5 * b, 3, speculated=True)


def test_high_acceptance_with_cheap_drafts_speculates_fully():
    controller = SpecController(SpecConfig(speculative_method="ngram", num_speculative_tokens=4))
    feed(controller, a=0.003, b=0.0001, draft_cost=0.0)
    r = request("a")
    for _ in range(10):
        controller.record_verify(r.request_id, 4, 4)
    assert controller.plan([r], [10]) == [4]
    assert controller.plan([r], [2]) == [2]  # capped by the room left


def test_low_acceptance_with_costly_drafts_stops_then_probes():
    controller = SpecController(SpecConfig(speculative_method="draft", num_speculative_tokens=4,
                                           spec_probe_interval=3))
    feed(controller, a=0.003, b=0.0005, draft_cost=0.001)
    r = request("b")
    for _ in range(10):
        controller.record_verify(r.request_id, 4, 0)
    plans = [controller.plan([r], [10])[0] for _ in range(12)]
    assert set(plans) == {0, 1} and plans.count(1) >= 2  # off, with one-token probes
    # Acceptance comes back: speculation resumes.
    for _ in range(20):
        controller.record_verify(r.request_id, 4, 4)
    assert controller.plan([r], [10]) == [4]


def test_idle_requests_probe_on_the_same_step():
    """A probe turns its whole step into a verification step, so requests that stopped
    speculating probe together, once per interval, not each on its own schedule."""
    controller = SpecController(SpecConfig(speculative_method="draft", num_speculative_tokens=4,
                                           spec_probe_interval=8))
    feed(controller, a=0.003, b=0.0005, draft_cost=0.001)
    for batch in (4, 8):  # the guards of these batch sizes have a plain baseline
        for _ in range(3):
            controller.record_step(0.003, batch, speculated=False, batch=batch)
    requests = [request(f"idle{i}") for i in range(4)]
    plans = []
    for step in range(32):
        if step % 3 == 0 and len(requests) < 12:  # arrivals at different steps
            requests.append(request(f"late{step}"))
        for r in requests:
            for _ in range(10):
                controller.record_verify(r.request_id, 4, 0)
        plans.append(controller.plan(requests, [10] * len(requests)))
    probe_steps = [i for i, plan in enumerate(plans) if any(plan)]
    assert all(set(plans[i]) == {1} for i in probe_steps)  # everyone probes together
    assert len(probe_steps) == 4  # once per 8 steps


def test_adaptive_off_always_uses_k():
    controller = SpecController(SpecConfig(speculative_method="draft", spec_adaptive=False,
                                           num_speculative_tokens=4))
    feed(controller, a=0.003, b=0.0005, draft_cost=0.01)
    r = request("c")
    controller.record_verify(r.request_id, 4, 0)
    assert controller.plan([r], [10]) == [4]


def test_guard_turns_speculation_off_when_measured_steps_are_slower():
    controller = SpecController(SpecConfig(speculative_method="ngram", num_speculative_tokens=4,
                                           spec_probe_interval=8))
    feed(controller, a=0.003, b=0.0001, draft_cost=0.0)
    r = request("d")
    for _ in range(10):
        controller.record_verify(r.request_id, 4, 4)
    assert controller.plan([r], [10]) == [4]  # the cost model says: speculate
    for _ in range(20):  # ...but whole steps measure slower per emitted token (7%)
        controller.record_step(0.0064, 2, speculated=True)
        controller.record_step(0.003, 1, speculated=False)
    assert controller.speculation_losing()

    def serve(steps: int, spec_cost: float) -> list[int]:
        """Plan and record whole steps as the engine does: a speculative step emits 2."""
        plans = []
        for _ in range(steps):
            k = controller.plan([r], [10])[0]
            if k:
                controller.record_step(spec_cost, 2, speculated=True)
            else:
                controller.record_step(0.003, 1, speculated=False)
            plans.append(k)
        return plans

    plans = serve(500, spec_cost=0.0064)
    spec_steps = [i for i, k in enumerate(plans) if k]
    # Retries: bursts of at most 3 speculative steps (a fresh measurement)...
    bursts = [[spec_steps[0]]]
    for i in spec_steps[1:]:
        if i <= bursts[-1][-1] + 2:  # a forced plain step may split a burst
            bursts[-1].append(i)
        else:
            bursts.append([i])
    assert 3 <= len(bursts) <= 6 and all(len(b) <= 3 for b in bursts)
    # ...further apart each time they lose.
    gaps = [b[0] - a[0] for a, b in zip(bursts, bursts[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]
    # Speculation becomes cheap (a retry measures it winning): back on for good.
    plans = serve(300, spec_cost=0.004)
    assert not controller.speculation_losing()
    assert sum(1 for k in plans[-32:] if k) >= 28
    # A clear win (a third faster per token): one forced plain step per 4 intervals.
    plans = [controller.plan([r], [10])[0] for _ in range(32)]
    assert plans.count(4) == 31 and plans.count(0) == 1
    # A narrow one (5%): one per interval, the baseline has to stay fresh.
    for _ in range(30):
        k = controller.plan([r], [10])[0]
        controller.record_step(0.0057 if k else 0.003, 2 if k else 1, speculated=bool(k))
    plans = [controller.plan([r], [10])[0] for _ in range(8)]
    assert plans.count(4) == 7 and plans.count(0) == 1


def test_padded_rows_make_every_k_cost_alike():
    """On the CPU BLAS path 2-8 tokens cost one padded 8-row product: measured that
    way, a request at middling acceptance drafts all k; costed per token it drafts few."""
    from tokenmill.layers.cpu_blas import padded_rows

    def step_seconds(tokens: int) -> float:  # what a padded product costs
        return 0.002 + 0.0002 * padded_rows(tokens)

    plans = {}
    for name, rows in (("padded", padded_rows), ("per token", None)):
        config = SpecConfig(speculative_method="ngram", num_speculative_tokens=7)
        controller = SpecController(config, rows) if rows else SpecController(config)
        for tokens in (1, 3, 8, 1, 5, 2, 1, 6):
            controller.record_forward(tokens, step_seconds(tokens))
        r = request(name)
        for _ in range(20):  # acceptance settles near 0.6
            controller.record_verify(r.request_id, 5, 3)
        plans[name] = controller.plan([r], [10])[0]
    assert plans["padded"] == 7
    assert 0 < plans["per token"] < 7


def test_a_heavy_loss_is_retried_rarely():
    """A retry costs 3 speculative steps at the measured loss on each token they emit:
    at 5x a plain step's time per token, retries wait the longest interval (64 probe
    intervals), where a loss of a few percent is retried after a few intervals."""
    config = SpecConfig(speculative_method="eagle", num_speculative_tokens=4,
                        spec_probe_interval=8)

    def first_retry(spec_cost: float) -> int:
        controller = SpecController(config)
        feed(controller, a=0.003, b=0.0001, draft_cost=0.0)
        r = request("e")
        for _ in range(10):
            controller.record_verify(r.request_id, 4, 4)
        for _ in range(20):
            controller.record_step(spec_cost, 2, speculated=True)
            controller.record_step(0.003, 1, speculated=False)
        assert controller.speculation_losing()
        for step in range(1, 1000):
            if controller.plan([r], [10])[0]:
                return step
            controller.record_step(0.003, 1, speculated=False)
        return 1000

    assert first_retry(0.030) >= LONGEST_WAIT * 8  # 5x: the longest wait
    # 7% on 2 tokens a step: 3 steps lose ~0.6 of a plain step, 1% of ~60 steps.
    assert first_retry(0.0064) <= 8 * 8


def test_new_requests_start_from_the_acceptance_measured_lately():
    controller = SpecController(SpecConfig(speculative_method="draft", num_speculative_tokens=4))
    feed(controller, a=0.003, b=0.0001, draft_cost=0.0005)
    assert controller.state("first").alpha == pytest.approx(0.6)  # the prior
    old = request("old")
    for _ in range(30):  # the proposer keeps missing
        controller.record_verify(old.request_id, 4, 0)
    new = request("new")
    assert controller.state(new.request_id).alpha < 0.1
    assert controller.plan([new], [10]) == [0]  # not tried afresh on every new request


def test_the_guard_keeps_a_verdict_per_batch_size():
    """Speculation that loses with 8 requests in a step stays off there, while single
    requests, where it wins, keep speculating (and the reverse is not unlearnt)."""
    controller = SpecController(SpecConfig(speculative_method="ngram", num_speculative_tokens=4,
                                           spec_probe_interval=8))
    feed(controller, a=0.003, b=0.0001, draft_cost=0.0)
    alone, batch = request("alone"), [request(f"b{i}") for i in range(8)]
    for r in [alone, *batch]:
        for _ in range(10):
            controller.record_verify(r.request_id, 4, 4)
    for _ in range(20):
        controller.record_step(0.010, 8, speculated=False, batch=8)
        controller.record_step(0.030, 16, speculated=True, batch=8)  # 1.5x per token
    assert controller.speculation_losing(8) and not controller.speculation_losing(1)
    plans_alone = [controller.plan([alone], [10]) for _ in range(16)]
    plans_batch = [controller.plan(batch, [10] * 8) for _ in range(16)]
    assert sum(1 for p in plans_alone if p[0]) >= 14
    assert not any(any(p) for p in plans_batch)


def test_a_loss_at_a_smaller_batch_carries_over_to_larger_ones():
    """Measured losing with 8 requests a step, a batch of 16 starts with speculation
    off (no start-up steps paid to learn it) and first retries after 8's wait; a
    smaller batch learns for itself."""
    controller = SpecController(SpecConfig(speculative_method="eagle", num_speculative_tokens=4,
                                           spec_probe_interval=8))
    feed(controller, a=0.003, b=0.0001, draft_cost=0.0)
    batch = [request(f"b{i}") for i in range(16)]
    for r in batch:
        for _ in range(10):
            controller.record_verify(r.request_id, 4, 4)
    for _ in range(20):
        controller.record_step(0.010, 8, speculated=False, batch=8)
        controller.record_step(0.030, 16, speculated=True, batch=8)
    assert controller.speculation_losing(8)
    wait = controller.guard(8).interval
    first = None
    for step in range(1, 600):
        if any(controller.plan(batch, [10] * 16)):
            first = step
            break
        controller.record_step(0.020, 16, speculated=False, batch=16)
    assert first is not None and first >= wait
    assert not controller.speculation_losing(4)
    assert any(any(controller.plan(batch[:4], [10] * 4)) for _ in range(4))


def test_features_pause_while_speculation_is_off():
    """A feature-level proposer is fed hidden states while speculation may run, not
    while the guard keeps it off, and again a few steps before the retry."""
    from tokenmill.speculative.controller import FEATURE_LEAD

    controller = SpecController(SpecConfig(speculative_method="eagle", num_speculative_tokens=4,
                                           spec_probe_interval=8))
    feed(controller, a=0.003, b=0.0001, draft_cost=0.0)
    batch = [request(f"b{i}") for i in range(8)]
    assert controller.wants_features(8)  # nothing measured yet
    for _ in range(20):
        controller.record_step(0.010, 8, speculated=False, batch=8)
        controller.record_step(0.030, 16, speculated=True, batch=8)
    wanted = []
    for _ in range(1000):
        wanted.append(controller.wants_features(8))
        speculated = any(controller.plan(batch, [10] * 8))
        controller.record_step(0.030 if speculated else 0.010, 16 if speculated else 8,
                               speculated=speculated, batch=8)
        if speculated:
            break
    assert speculated, "the guard retried"
    assert not wanted[1] and wanted[-1]
    assert wanted.count(True) <= FEATURE_LEAD + 2
    assert controller.wants_features(1)  # another batch size speculates meanwhile


def test_a_retry_must_win_clearly_to_turn_speculation_back_on():
    """Once measured losing, a retry that measures 4% faster (above the 3% that keeps
    speculation on, within 3 steps' noise) leaves it off; 10% faster turns it on."""

    def after_retry(spec_cost: float) -> bool:
        controller = SpecController(SpecConfig(speculative_method="eagle",
                                               num_speculative_tokens=4, spec_probe_interval=8))
        feed(controller, a=0.003, b=0.0001, draft_cost=0.0)
        r = request("h")
        for _ in range(10):
            controller.record_verify(r.request_id, 4, 4)
        for _ in range(20):
            controller.record_step(0.0064, 2, speculated=True)  # 7% slower per token
            controller.record_step(0.003, 1, speculated=False)
        assert controller.speculation_losing()
        retried = 0
        for _ in range(400):
            k = controller.plan([r], [10])[0]
            retried += bool(k)
            controller.record_step(spec_cost if k else 0.003, 2 if k else 1, speculated=bool(k))
            if retried >= 3:
                break
        assert retried >= 3
        return not controller.speculation_losing()

    assert not after_retry(0.00576)  # 4% faster per token
    assert after_retry(0.0054)  # 10% faster
