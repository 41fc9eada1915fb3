"""Per-request logits processors: the one pipeline every change to a request's
next-token logits goes through before sampling (and before verifying drafts).

A processor is built for a request at each position it samples from, out of its
SamplingParams and its token history there (`build_logits_processors`), and changes
that position's logits row in place. Processors of one kind are applied together
(`apply_rows`), so a kind can be vectorised over the batch (penalties are).
Logprobs are reported from the raw model distribution, before any processor.

Order: banned tokens (min_tokens keeps EOS and stop ids away) -> repetition /
presence / frequency penalties -> logit bias (OpenAI's) -> the thinking budget (last,
so a forced token wins over everything before it). A new kind (a grammar) is a class
here and one entry in `LOGITS_PROCESSORS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tokenmill.reasoning import ThinkingTokens, forced_sequence, thinking_progress
from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """What a request has produced before the position being sampled."""

    num_output_tokens: int
    eos_token_ids: frozenset[int]
    # Only when params.reads_history (the engine sends the ids then).
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    # A reasoning model's markers, when params.controls_thinking.
    thinking: ThinkingTokens | None = None


class LogitsProcessor(ABC):
    @abstractmethod
    def apply(self, logits: torch.Tensor, history: TokenHistory) -> None:
        """Change one position's logits [V] in place."""

    @classmethod
    def apply_rows(cls, logits: torch.Tensor, rows: list[int],
                   processors: list[LogitsProcessor], histories: list[TokenHistory]) -> None:
        """Apply processors[i] (all of this class) to logits[rows[i]] in place."""
        for row, processor, history in zip(rows, processors, histories, strict=True):
            processor.apply(logits[row], history)


@dataclass(frozen=True)
class BanTokens(LogitsProcessor):
    """Tokens that must not be sampled yet: EOS and stop ids while min_tokens is not
    reached."""

    token_ids: tuple[int, ...]

    def apply(self, logits: torch.Tensor, history: TokenHistory) -> None:
        logits[list(self.token_ids)] = float("-inf")

    @classmethod
    def build(cls, params: SamplingParams, history: TokenHistory) -> BanTokens | None:
        if history.num_output_tokens >= params.min_tokens:
            return None
        return cls(tuple(sorted(history.eos_token_ids | set(params.stop_token_ids))))


@dataclass(frozen=True)
class Penalties(LogitsProcessor):
    """Repetition penalty (CTRL-style, on prompt and output tokens: shrink toward zero),
    then OpenAI's presence and frequency penalties on output tokens."""

    presence: float
    frequency: float
    repetition: float

    def apply(self, logits: torch.Tensor, history: TokenHistory) -> None:
        self.apply_rows(logits[None], [0], [self], [history])

    @classmethod
    def apply_rows(cls, logits: torch.Tensor, rows: list[int],
                   processors: list[LogitsProcessor], histories: list[TokenHistory]) -> None:
        device, vocab = logits.device, logits.shape[-1]
        counts = torch.zeros(len(rows), vocab, dtype=torch.float32, device=device)
        in_prompt = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
        for i, history in enumerate(histories):
            if history.output_token_ids:
                ids = torch.tensor(history.output_token_ids, dtype=torch.int64, device=device)
                counts[i].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
            if history.prompt_token_ids:
                in_prompt[i, torch.tensor(history.prompt_token_ids, dtype=torch.int64,
                                          device=device)] = True

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in processors], dtype=torch.float32,
                                device=device).unsqueeze(1)

        index = torch.tensor(rows, dtype=torch.int64, device=device)
        selected = logits.index_select(0, index)
        seen = in_prompt | (counts > 0)
        rep = column("repetition")
        penalised = torch.where(seen, torch.where(selected > 0, selected / rep, selected * rep),
                                selected)
        penalised = penalised - column("frequency") * counts
        penalised = penalised - column("presence") * (counts > 0).float()
        logits.index_copy_(0, index, penalised.to(logits.dtype))

    @classmethod
    def build(cls, params: SamplingParams, history: TokenHistory) -> Penalties | None:
        if not params.uses_penalties:
            return None
        return cls(params.presence_penalty, params.frequency_penalty, params.repetition_penalty)


@dataclass(frozen=True)
class LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: a value added to given tokens' logits (-100 bans, +100
    nearly forces)."""

    token_ids: tuple[int, ...]
    values: tuple[float, ...]

    def apply(self, logits: torch.Tensor, history: TokenHistory) -> None:
        index = torch.tensor(self.token_ids, dtype=torch.int64, device=logits.device)
        bias = torch.tensor(self.values, dtype=logits.dtype, device=logits.device)
        logits.index_add_(0, index, bias)

    @classmethod
    def build(cls, params: SamplingParams, history: TokenHistory) -> LogitBias | None:
        if not params.logit_bias:
            return None
        tokens = tuple(params.logit_bias)
        return cls(tokens, tuple(float(params.logit_bias[t]) for t in tokens))


@dataclass(frozen=True)
class ThinkingBudget(LogitsProcessor):
    """A reasoning model's thinking budget and minimum. Once the thinking holds
    `budget - len(bridge)` tokens, the bridge and the end marker are forced one token
    per position (the bridge is dropped when it does not fit the budget), so the end
    marker comes exactly after `budget` thinking tokens and the model then answers.
    Before `min_thinking` tokens the end marker's first token is banned, and after the
    thinking has ended a one-token end marker is banned for good. The state is
    recomputed from the output so far at every position, so verification rows (which
    see the drafts before them as output), preemption and prefix caching need nothing
    more."""

    forced_token: int | None = None
    banned_token: int | None = None

    def apply(self, logits: torch.Tensor, history: TokenHistory) -> None:
        if self.forced_token is not None:
            logits.fill_(float("-inf"))
            logits[self.forced_token] = 0.0
        elif self.banned_token is not None:
            logits[self.banned_token] = float("-inf")

    @classmethod
    def build(cls, params: SamplingParams, history: TokenHistory) -> ThinkingBudget | None:
        thinking, output = history.thinking, history.output_token_ids
        if thinking is None or output is None or not params.controls_thinking:
            return None
        progress = thinking_progress(output, thinking)
        if progress.ended and len(thinking.end_ids) == 1:
            # The thinking happens once: a controlled request's answer cannot close it
            # again (a model cut short by the budget would otherwise go on thinking in
            # its answer and write the marker there).
            return cls(banned_token=thinking.end_ids[0])
        if not progress.started or progress.ended:
            return None
        count = progress.num_thinking_tokens
        budget = params.thinking_budget
        if budget is not None:
            forced = forced_sequence(thinking, budget)
            first = budget - (len(forced) - len(thinking.end_ids))
            if 0 <= count - first < len(forced):
                return cls(forced_token=forced[count - first])
        if count < params.min_thinking:
            return cls(banned_token=thinking.end_ids[0])
        return None


# Every kind, in the order they apply.
LOGITS_PROCESSORS: list[type] = [BanTokens, Penalties, LogitBias, ThinkingBudget]


def build_logits_processors(params: SamplingParams, history: TokenHistory
                            ) -> list[LogitsProcessor]:
    """The processors that change this request's logits at this position."""
    built = (kind.build(params, history) for kind in LOGITS_PROCESSORS)
    return [processor for processor in built if processor is not None]


def apply_logits_processors(logits: torch.Tensor,
                            per_row: list[tuple[list[LogitsProcessor], TokenHistory]]
                            ) -> torch.Tensor:
    """Apply each row's processors; returns logits (a changed copy when any applied)."""
    if not any(processors for processors, _ in per_row):
        return logits
    logits = logits.clone()
    for kind in LOGITS_PROCESSORS:
        rows, processors, histories = [], [], []
        for row, (row_processors, history) in enumerate(per_row):
            for processor in row_processors:
                if type(processor) is kind:
                    rows.append(row)
                    processors.append(processor)
                    histories.append(history)
        if rows:
            kind.apply_rows(logits, rows, processors, histories)
    return logits
