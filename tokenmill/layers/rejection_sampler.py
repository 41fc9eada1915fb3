"""Exact verification of speculative tokens.

Greedy: accept draft tokens while each equals the target's argmax at its position;
the first mismatch is replaced by the target's argmax (so the output is exactly
what plain greedy decoding produces). Sampling (Leviathan et al. 2023; Chen et al.
2023): accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection draw from norm(max(p_i - q_i, 0)) and stop; when every draft is accepted,
draw a bonus token from p_{k+1}. p and q are the distributions after the request's
temperature / min-p / top-k / top-p processing, so the emitted tokens follow exactly
the distribution plain sampling would draw from.

Seeded sampling (`verify_by_sampling`): the target's token at each position is drawn
exactly as plain sampling draws it, with the request's position-keyed uniform, and a
draft is accepted while it equals that token. The emitted tokens are then not only
distributed as plain sampling's but identical to them, so a seeded request returns the
same text with speculation on or off. For a deterministic draft (n-gram, greedy) this
is rejection sampling itself (accepted with probability p(x), the residual is p
without x); for a sampled draft it accepts less often than min(1, p / q) would (the
draft is drawn with the same uniform, which couples it to the target's draw).
"""

from __future__ import annotations

import torch

from tokenmill.layers.sampler import build_sampling_batch, filter_logits, sample
from tokenmill.sampling_params import SamplingParams


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[N, V] float32 probabilities after each row's temperature, min-p, top-k and top-p.

    Rows with temperature 0 get a one-hot at the argmax (greedy is the T -> 0 limit).
    """
    logits = logits.float()
    batch = build_sampling_batch(params, [None] * len(params), logits.shape[-1], logits.device)
    sorted_logits, order = filter_logits(logits, batch)
    probs = torch.zeros_like(logits).scatter_(1, order, sorted_logits.softmax(dim=-1))
    greedy = batch.temperature == 0
    if bool(greedy.any()):
        one_hot = torch.zeros_like(logits).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


def verify_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    """Tokens to emit: the accepted drafts then the target's own next token.

    target_argmax[i] is the target's choice after the context plus draft[:i]
    (len(draft) + 1 entries): its argmax, or (verify_by_sampling) its seeded draw.
    """
    emitted = []
    for proposed, chosen in zip(draft, target_argmax, strict=False):
        if proposed != chosen:
            break
        emitted.append(proposed)
    emitted.append(target_argmax[len(emitted)])
    return emitted


def verify_sampled(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                   generator: torch.Generator) -> list[int]:
    """Rejection sampling of one request's drafts.

    p: [k + 1, V] target probabilities (processed); q: [k, V] draft probabilities, or
    None for a deterministic proposal (q one-hot on the draft token). Returns the
    accepted drafts followed by one corrected or bonus token.
    """
    k = len(draft)
    draft_ids = torch.tensor(draft, dtype=torch.int64, device=p.device)
    p_draft = p[:k].gather(1, draft_ids.unsqueeze(1)).squeeze(1)
    if q is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = q.gather(1, draft_ids.unsqueeze(1)).squeeze(1)
    uniforms = torch.rand(k + 1, generator=generator).to(p.device)
    accept = (uniforms[:k] * q_draft < p_draft).tolist()  # u < p / q, without dividing
    emitted: list[int] = []
    for i in range(k):
        if not accept[i]:
            if q is None:
                residual = p[i].clone()
                residual[draft[i]] = 0.0
            else:
                residual = (p[i] - q[i]).clamp_(min=0.0)
            total = float(residual.sum())
            if total <= 0.0:  # p == q exactly (cannot reject then; numerical guard)
                residual, total = p[i], float(p[i].sum())
            emitted.append(_draw(residual / total, float(uniforms[k])))
            return emitted
        emitted.append(draft[i])
    emitted.append(_draw(p[k], float(uniforms[k])))
    return emitted


def _draw(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw with a given uniform."""
    cdf = probs.cumsum(0)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], device=cdf.device)))
    return min(index, probs.shape[0] - 1)


def verify_by_sampling(logits: torch.Tensor, params: SamplingParams, draft: list[int],
                       uniforms: list[float]) -> list[int]:
    """Seeded verification: the target's draws at the k + 1 positions (processed
    logits [k + 1, V], uniforms from position_uniform), drafts accepted while equal."""
    batch = build_sampling_batch([params] * len(uniforms), list(uniforms), logits.shape[-1],
                                 logits.device)
    drawn = sample(logits, batch, torch.Generator()).token_ids.tolist()
    return verify_greedy(drawn, draft)
