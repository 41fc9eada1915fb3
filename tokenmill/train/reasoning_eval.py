"""Scoring a reasoning model on held-out items of the task family, through tokenmill's
own engine: accuracy by level, thinking lengths and tokens per request, under any
SamplingParams (a thinking budget among them). The model card, the length-penalty
experiment and benchmarks/bench_reasoning.py all score with these functions.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from tokenmill.llm import LLM
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.train.reasoning_data import HELD_OUT_SEED
from tokenmill.train.reasoning_tasks import LEVELS, ReasoningItem, generate_items, parse_answer

# Held-out items for scoring: their own seed, apart from training and held-out loss.
EVAL_SEED = HELD_OUT_SEED + 1
MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class ItemResult:
    level: int
    correct: bool
    thinking_tokens: int
    output_tokens: int
    # The thinking finished with its end marker (not cut off by max_tokens).
    answered: bool
    # The model's thinking wrote values substituted (`b = 6 * 3 = 18`).
    verbose: bool
    e2e_seconds: float


def eval_items(per_level: int, seed: int = EVAL_SEED) -> list[ReasoningItem]:
    """per_level held-out items of every level, in level order."""
    return generate_items(seed, per_level * len(LEVELS))


def greedy_params(**fields) -> SamplingParams:
    return SamplingParams(**({"temperature": 0, "max_tokens": MAX_NEW_TOKENS} | fields))


def ask(llm: LLM, items: list[ReasoningItem], params: SamplingParams) -> list[RequestOutput]:
    """Each item asked as a chat message (all at once), answered under params."""
    prompts = [llm.apply_chat_template([{"role": "user", "content": item.program}])
               for item in items]
    return llm.generate(prompts, params)


def score(llm: LLM, items: list[ReasoningItem], params: SamplingParams) -> list[ItemResult]:
    """Each item asked, answered under params, checked."""
    return check(items, ask(llm, items, params))


def check(items: list[ReasoningItem], outputs: list[RequestOutput]) -> list[ItemResult]:
    """Whether each output's answer (the first integer after its thinking) is right."""
    results = []
    for item, output in zip(items, outputs, strict=True):
        completion = output.outputs[0]
        answered = completion.reasoning_content is not None and "</think>" in completion.text
        content = completion.content if answered else ""
        metrics = completion.metrics
        results.append(ItemResult(
            item.level, parse_answer(content or "") == item.answer,
            metrics.num_thinking_tokens, len(completion.token_ids), answered,
            writes_substitutions(completion.reasoning_content or ""),
            metrics.e2e_latency or 0.0))
    return results


def writes_substitutions(reasoning: str) -> bool:
    """A verbose trace: some line shows the values before the result (`b = 6 * 3 = 18`)."""
    return any(line.count(" = ") >= 2 for line in reasoning.splitlines())


@dataclass(frozen=True)
class LevelSummary:
    level: int | None  # None: all levels together
    items: int
    accuracy: float
    mean_thinking: float
    mean_output_tokens: float
    verbose_share: float

    def as_dict(self) -> dict:
        return dict(vars(self))


def summarize(results: list[ItemResult]) -> list[LevelSummary]:
    """One row per level present, then one for all of them."""
    rows = []
    for level in sorted({r.level for r in results}) + [None]:
        chosen = [r for r in results if level is None or r.level == level]
        rows.append(LevelSummary(
            level, len(chosen), sum(r.correct for r in chosen) / len(chosen),
            statistics.mean(r.thinking_tokens for r in chosen),
            statistics.mean(r.output_tokens for r in chosen),
            sum(r.verbose for r in chosen) / len(chosen)))
    return rows


def thinking_percentiles(results: list[ItemResult], level: int | None
                         ) -> dict[str, float]:
    """Min, quartiles, p90 and max of the thinking tokens (of one level, or all)."""
    lengths = sorted(r.thinking_tokens for r in results if level is None or r.level == level)

    def at(q: float) -> float:
        return float(lengths[min(len(lengths) - 1, round(q * (len(lengths) - 1)))])

    return {"min": at(0.0), "p25": at(0.25), "median": at(0.5), "p75": at(0.75),
            "p90": at(0.9), "max": at(1.0)}
