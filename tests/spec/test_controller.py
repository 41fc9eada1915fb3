"""The adaptive switch: speculate as far as pays, stop when it does not, probe to resume."""

from __future__ import annotations

import pytest

from tokenmill.config import SpecConfig
from tokenmill.engine.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.controller import SpecController, StepCostFit, expected_tokens


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
        controller.record_verify(r, 4, 4)
    assert controller.plan([r], [10]) == [4]
    assert controller.plan([r], [2]) == [2]  # capped by the room left


def test_low_acceptance_with_costly_drafts_stops_then_probes():
    controller = SpecController(SpecConfig(speculative_method="draft", num_speculative_tokens=4,
                                           spec_probe_interval=3))
    feed(controller, a=0.003, b=0.0005, draft_cost=0.001)
    r = request("b")
    for _ in range(10):
        controller.record_verify(r, 4, 0)
    plans = [controller.plan([r], [10])[0] for _ in range(12)]
    assert set(plans) == {0, 1} and plans.count(1) >= 2  # off, with one-token probes
    # Acceptance comes back: speculation resumes.
    for _ in range(20):
        controller.record_verify(r, 4, 4)
    assert controller.plan([r], [10]) == [4]


def test_adaptive_off_always_uses_k():
    controller = SpecController(SpecConfig(speculative_method="draft", spec_adaptive=False))
    feed(controller, a=0.003, b=0.0005, draft_cost=0.01)
    r = request("c")
    controller.record_verify(r, 4, 0)
    assert controller.plan([r], [10]) == [4]


def test_guard_turns_speculation_off_when_measured_steps_are_slower():
    controller = SpecController(SpecConfig(speculative_method="ngram", num_speculative_tokens=4,
                                           spec_probe_interval=8))
    feed(controller, a=0.003, b=0.0001, draft_cost=0.0)
    r = request("d")
    for _ in range(10):
        controller.record_verify(r, 4, 4)
    assert controller.plan([r], [10]) == [4]  # the cost model says: speculate
    for _ in range(5):  # ...but whole steps measure slower per emitted token
        controller.record_step(0.010, 2, speculated=True)
        controller.record_step(0.003, 1, speculated=False)
    assert controller.speculation_losing
    plans = [controller.plan([r], [10])[0] for _ in range(64)]
    probes = [i for i, k in enumerate(plans) if k == 4]
    assert 2 <= len(probes) <= 4  # probes only, further apart each time
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]
    for _ in range(10):  # speculation becomes cheap again: back on
        controller.record_step(0.004, 4, speculated=True)
    assert not controller.speculation_losing
    plans = [controller.plan([r], [10])[0] for _ in range(8)]
    assert plans.count(4) == 7 and plans.count(0) == 1  # one forced plain step per interval
