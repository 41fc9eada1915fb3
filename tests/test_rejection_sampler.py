"""The verifier: greedy acceptance, and rejection sampling that preserves the target's
distribution exactly (checked on fixed p and q)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.rejection_sampler import processed_probs, verify_greedy, verify_sampled
from tokenmill.sampling_params import SamplingParams

P = torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01],
                  [0.05, 0.05, 0.10, 0.10, 0.20, 0.20, 0.15, 0.15]])
Q = torch.tensor([[0.05, 0.10, 0.40, 0.05, 0.20, 0.10, 0.05, 0.05]])


def test_greedy_accepts_the_matching_prefix_then_corrects():
    assert verify_greedy([4, 5, 6, 7], [4, 5, 9]) == [4, 5, 6]
    assert verify_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all accepted: bonus
    assert verify_greedy([8, 5], [4]) == [8]


def total_variation(samples: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=len(p)).float()
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_sampling_preserves_the_target_distribution(deterministic):
    # The first emitted token must follow p[0] exactly, whatever q proposes. 100k
    # samples put the sampling noise of the TV distance near 0.004.
    generator = torch.Generator().manual_seed(0)
    draws = torch.multinomial(Q[0], 100_000, replacement=True, generator=generator).tolist()
    firsts, accepted = [], 0
    for token in draws:
        if deterministic:  # a fixed proposal (n-gram): q is one-hot on it
            token = 2
        emitted = verify_sampled(P, [token], None if deterministic else Q, generator)
        firsts.append(emitted[0])
        accepted += len(emitted) == 2
    assert total_variation(torch.tensor(firsts), P[0]) < 0.01
    # Acceptance equals sum(min(p, q)) (for a fixed proposal: p of that token).
    expected = float(P[0, 2]) if deterministic else float(torch.minimum(P[0], Q[0]).sum())
    assert accepted / len(draws) == pytest.approx(expected, abs=0.01)


def test_bonus_token_follows_the_next_distribution():
    # q == p: everything is accepted and the bonus is drawn from p[1].
    generator = torch.Generator().manual_seed(1)
    q = P[:1]
    bonus = []
    for token in torch.multinomial(q[0], 40_000, replacement=True, generator=generator).tolist():
        emitted = verify_sampled(P, [token], q, generator)
        assert len(emitted) == 2
        bonus.append(emitted[1])
    assert total_variation(torch.tensor(bonus), P[1]) < 0.015


def test_processed_probs_follow_the_request_filters():
    logits = torch.log(P[:1].repeat(3, 1))
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, top_p=0.5)]
    probs = processed_probs(logits, params)
    assert probs[0, :2].tolist() == pytest.approx([0.30 / 0.55, 0.25 / 0.55])
    assert probs[0, 2:].sum() == 0
    assert probs[1].tolist() == [1.0] + [0.0] * 7  # greedy: one-hot on the argmax
    assert probs[2, :2].tolist() == pytest.approx([0.30 / 0.55, 0.25 / 0.55])
