"""Vectorised sampling over a batch of logits rows, with OpenAI/vLLM semantics.

Order: banned tokens (min_tokens) -> penalties -> greedy argmax, or temperature ->
min_p -> top_k -> top_p -> inverse-CDF draw. Each row draws its random number from
its own generator when the request has a seed, so a seeded request samples the same
tokens whatever else shares the batch. Logprobs are those of the raw model
distribution (before penalties and temperature), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor  # [B] int; >= vocab when disabled
    top_p: torch.Tensor  # [B] float
    min_p: torch.Tensor  # [B] float
    generators: list[torch.Generator | None]  # per row; None: the shared generator
    # Penalties (None when no row uses them).
    presence: torch.Tensor | None = None  # [B]
    frequency: torch.Tensor | None = None  # [B]
    repetition: torch.Tensor | None = None  # [B]
    output_counts: torch.Tensor | None = None  # [B, V] occurrences in the output so far
    seen_in_prompt: torch.Tensor | None = None  # [B, V] bool
    # (row, token ids) that must not be sampled yet (min_tokens keeps EOS away).
    banned: list[tuple[int, list[int]]] | None = None
    num_logprobs: int | None = None  # top alternatives to report (max over rows)

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B]
    logprobs: torch.Tensor | None = None  # [B] raw logprob of the chosen token
    ranks: torch.Tensor | None = None  # [B] 1 = most likely
    top_ids: torch.Tensor | None = None  # [B, N]
    top_logprobs: torch.Tensor | None = None  # [B, N]


def build_sampling_batch(params: list[SamplingParams], histories: list[tuple[list[int], list[int]]],
                         banned: list[tuple[int, list[int]]], generators: list[torch.Generator | None],
                         vocab_size: int, device: torch.device) -> SamplingBatch:
    """histories: (prompt ids, output ids) per row, read only when a row uses penalties."""
    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    batch = SamplingBatch(
        temperature=column([p.temperature for p in params], torch.float32),
        top_k=column([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64),
        top_p=column([p.top_p for p in params], torch.float32),
        min_p=column([p.min_p for p in params], torch.float32),
        generators=generators,
        banned=banned or None,
    )
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    batch.num_logprobs = max(wanted) if wanted else None
    if any(p.uses_penalties for p in params):
        rows = len(params)
        counts = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)
        in_prompt = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)
        for row, (prompt_ids, output_ids) in enumerate(histories):
            if not params[row].uses_penalties:
                continue
            if output_ids:
                ids = torch.tensor(output_ids, dtype=torch.int64, device=device)
                counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
            if prompt_ids:
                in_prompt[row, torch.tensor(prompt_ids, dtype=torch.int64, device=device)] = True
        batch.presence = column([p.presence_penalty for p in params], torch.float32)
        batch.frequency = column([p.frequency_penalty for p in params], torch.float32)
        batch.repetition = column([p.repetition_penalty for p in params], torch.float32)
        batch.output_counts, batch.seen_in_prompt = counts, in_prompt
    return batch


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    counts = batch.output_counts
    seen = batch.seen_in_prompt | (counts > 0)
    rep = batch.repetition.unsqueeze(1)
    # Repetition penalty (CTRL-style, on prompt and output tokens): shrink toward zero.
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    # OpenAI presence/frequency penalties on output tokens only.
    logits = logits - batch.frequency.unsqueeze(1) * counts
    return logits - batch.presence.unsqueeze(1) * (counts > 0).float()


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, min_p, top_k and top_p. Returns (sorted filtered logits, sort order)."""
    temperature = torch.where(batch.temperature > 0, batch.temperature,
                              torch.ones_like(batch.temperature))
    logits = logits / temperature.unsqueeze(1)
    probs = logits.softmax(dim=-1)
    if bool((batch.min_p > 0).any()):
        floor = batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= batch.top_k.unsqueeze(1), float("-inf"))
    if bool((batch.top_p < 1).any()):
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        sorted_logits = sorted_logits.masked_fill(mass_before >= batch.top_p.unsqueeze(1),
                                                  float("-inf"))
    return sorted_logits, order


def draw_uniforms(generators: list[torch.Generator | None], shared: torch.Generator,
                  device: torch.device) -> torch.Tensor:
    """One U[0,1) per row: from the row's own generator if seeded, else the shared one."""
    values = [float(torch.rand(1, generator=g if g is not None else shared)) for g in generators]
    return torch.tensor(values, dtype=torch.float32, device=device)


def sample(logits: torch.Tensor, batch: SamplingBatch, shared: torch.Generator) -> SamplerOutput:
    raw_logprobs = logits.log_softmax(dim=-1) if batch.num_logprobs is not None else None
    if batch.banned:
        logits = logits.clone()
        for row, token_ids in batch.banned:
            logits[row, token_ids] = float("-inf")
    if batch.output_counts is not None:
        logits = apply_penalties(logits, batch)
    token_ids = logits.argmax(dim=-1)
    if not batch.all_greedy:
        sorted_logits, order = filter_logits(logits, batch)
        cdf = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        u = draw_uniforms(batch.generators, shared, logits.device) * cdf[:, -1]
        index = torch.searchsorted(cdf, u.unsqueeze(1)).clamp_(max=cdf.shape[-1] - 1)
        sampled = order.gather(1, index).squeeze(1)
        token_ids = torch.where(batch.temperature > 0, sampled, token_ids)
    out = SamplerOutput(token_ids=token_ids)
    if raw_logprobs is not None:
        out.logprobs, out.ranks, out.top_ids, out.top_logprobs = token_logprobs(
            raw_logprobs, token_ids, batch.num_logprobs)
    return out


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chosen-token logprob and rank, and the top num_top alternatives, per row."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (
        logprobs[:, :0], token_ids.new_zeros(len(token_ids), 0))
    return chosen, ranks, top_ids, top_logprobs
