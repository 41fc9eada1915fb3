"""Sampler and logits processors against a straightforward per-row reference
implementation."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.layers.logits_processors import (
    TokenHistory,
    apply_logits_processors,
    build_logits_processors,
)
from tokenmill.layers.sampler import build_sampling_batch, filter_logits, position_uniform, sample
from tokenmill.sampling_params import SamplingParams

VOCAB = 12
CPU = torch.device("cpu")


def processed(logits: torch.Tensor, params: list[SamplingParams],
              histories: list[TokenHistory]) -> torch.Tensor:
    """logits after each row's processors, as the worker applies them."""
    return apply_logits_processors(logits, [(build_logits_processors(p, h), h)
                                            for p, h in zip(params, histories, strict=True)])


def reference_distribution(logits: list[float], p: SamplingParams, prompt: list[int],
                           output: list[int]) -> list[float]:
    """The textbook definition, one row, plain Python."""
    logits = list(logits)
    counts = {t: output.count(t) for t in set(output)}
    for t in range(len(logits)):
        if t in counts or t in prompt:
            r = p.repetition_penalty
            logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
        c = counts.get(t, 0)
        logits[t] -= p.frequency_penalty * c + p.presence_penalty * (1 if c else 0)
    scaled = [x / p.temperature for x in logits]
    z = sum(math.exp(x) for x in scaled)
    probs = [math.exp(x) / z for x in scaled]
    keep = [True] * len(probs)
    if p.min_p > 0:
        floor = p.min_p * max(probs)
        keep = [k and q >= floor for k, q in zip(keep, probs, strict=True)]
    order = sorted(range(len(probs)), key=lambda t: -scaled[t])
    if p.top_k > 0:
        for t in order[p.top_k:]:
            keep[t] = False
    kept = [t for t in order if keep[t]]
    mass = sum(probs[t] for t in kept)
    cumulative = 0.0
    final = set()
    for t in kept:
        if cumulative >= p.top_p * mass:
            break
        final.add(t)
        cumulative += probs[t]
    z = sum(probs[t] for t in final)
    return [probs[t] / z if t in final else 0.0 for t in range(len(probs))]


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5),
    SamplingParams(temperature=0.8, repetition_penalty=1.5),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: repr(p)[15:80])
def test_filtered_distribution_matches_reference(params):
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 2
    prompt, output = [1, 2, 3], [3, 4, 4, 7]
    history = TokenHistory(len(output), frozenset(), prompt, output)
    batch = build_sampling_batch([params] * 3, [None] * 3, VOCAB, CPU)
    penalized = processed(logits, [params] * 3, [history] * 3)
    sorted_logits, order = filter_logits(penalized, batch)
    probs = torch.zeros_like(logits).scatter_(1, order, sorted_logits.softmax(-1))
    for row in range(3):
        expected = reference_distribution(logits[row].tolist(), params, prompt, output)
        torch.testing.assert_close(probs[row], torch.tensor(expected), atol=1e-5, rtol=1e-4)


def test_empirical_frequencies_follow_the_distribution():
    torch.manual_seed(1)
    logits = torch.randn(1, VOCAB)
    params = SamplingParams(temperature=0.8, top_k=6)
    expected = torch.tensor(reference_distribution(logits[0].tolist(), params, [], []))
    shared = torch.Generator().manual_seed(0)
    rows = 20000
    batch = build_sampling_batch([params] * rows, [None] * rows, VOCAB, CPU)
    tokens = sample(logits.expand(rows, VOCAB), batch, shared).token_ids
    freq = torch.bincount(tokens, minlength=VOCAB).float() / rows
    assert 0.5 * (freq - expected).abs().sum() < 0.02
    assert freq[expected == 0].sum() == 0


def test_seeded_row_is_independent_of_batch_composition():
    torch.manual_seed(2)
    target = torch.randn(1, VOCAB)
    params = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)

    def draws(extra_rows: int, steps: int = 20) -> list[int]:
        shared = torch.Generator().manual_seed(extra_rows)
        out = []
        for position in range(steps):
            logits = torch.cat([torch.randn(extra_rows, VOCAB), target])
            uniforms = [None] * extra_rows + [position_uniform(1234, 0, position)]
            batch = build_sampling_batch([other] * extra_rows + [params], uniforms, VOCAB, CPU)
            out.append(int(sample(logits, batch, shared).token_ids[-1]))
        return out

    assert draws(0) == draws(3) == draws(7)
    assert len(set(draws(0))) > 1  # the uniforms differ by position


def test_position_uniforms_are_uniform_and_keyed_by_seed_stream_and_position():
    values = [position_uniform(7, 0, p) for p in range(20000)]
    assert 0.0 <= min(values) and max(values) < 1.0
    assert abs(sum(values) / len(values) - 0.5) < 0.01
    histogram = torch.histc(torch.tensor(values), bins=10, min=0.0, max=1.0)
    assert (histogram / len(values) - 0.1).abs().max() < 0.01
    assert position_uniform(7, 0, 5) == position_uniform(7, 0, 5)
    assert len({position_uniform(7, 0, 5), position_uniform(8, 0, 5),
                position_uniform(7, 1, 5), position_uniform(7, 0, 6)}) == 4


def test_greedy_rows_take_argmax_and_banned_tokens_are_never_chosen():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0], [3.0, 1.0, 0.0, 2.0]])
    # Row 0 is below min_tokens: its EOS (1) is banned; row 1 reached it.
    params = [SamplingParams(temperature=0, min_tokens=2), SamplingParams(temperature=0)]
    histories = [TokenHistory(1, frozenset({1})), TokenHistory(5, frozenset({1}))]
    batch = build_sampling_batch(params, [None, None], 4, CPU)
    out = sample(processed(logits, params, histories), batch, torch.Generator())
    assert out.token_ids.tolist() == [3, 0]
    assert logits[0, 1] == 5.0  # the caller's logits are left alone


def test_logprobs_are_raw_model_logprobs_with_rank():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    params = [SamplingParams(temperature=0, logprobs=2, repetition_penalty=1.5)]
    history = TokenHistory(0, frozenset(), [0], [])
    batch = build_sampling_batch(params, [None], 4, CPU)
    raw = logits.log_softmax(-1)
    out = sample(processed(logits, params, [history]), batch, torch.Generator(), raw)
    raw = raw[0]
    # The penalty on token 0 (2.0 / 1.5 = 1.33) keeps it first; logprobs stay unpenalised.
    assert out.token_ids.tolist() == [0]
    assert out.logprobs[0].item() == pytest.approx(raw[0].item())
    assert out.ranks.tolist() == [1]
    assert out.top_ids[0].tolist() == [0, 1]
