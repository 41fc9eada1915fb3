"""The shape of ``train_log.json`` across training stages.

A model can be trained in stages: the first from random initialisation, later
ones continuing from the saved weights (``--init-from``).  Each stage records its
own schedule and timings under ``"stages"``; the top-level ``steps``,
``tokens_seen`` and ``train_seconds`` are totals over all stages, and
``history`` is one continuous curve.  Logs written before stages existed hold a
single stage's fields at the top level; ``stages_of`` reads both shapes.
"""

from __future__ import annotations

STAGE_KEYS = (
    "init",
    "schedule",
    "steps",
    "tokens_seen",
    "train_seconds",
    "phase_steps",
    "phase_seconds",
    "max_seconds",
    "steps_at_thread_count",
)


def stages_of(log: dict) -> list[dict]:
    """The list of stage records of a train log, oldest first."""
    if "stages" in log:
        return log["stages"]
    single = {key: log.get(key) for key in STAGE_KEYS}
    single["init"] = "random"
    return [single]


def continue_history(earlier: dict, later: dict) -> dict:
    """``later`` history (counted from zero) appended to ``earlier`` as one curve."""
    if not earlier.get("steps"):
        return later
    step_offset = earlier["steps"][-1]
    token_offset = earlier["tokens"][-1]
    return {
        "steps": earlier["steps"] + [s + step_offset for s in later["steps"]],
        "tokens": earlier["tokens"] + [t + token_offset for t in later["tokens"]],
        "train_loss": earlier["train_loss"] + later["train_loss"],
        "eval_steps": earlier["eval_steps"] + [s + step_offset for s in later["eval_steps"]],
        "eval_tokens": earlier["eval_tokens"] + [t + token_offset for t in later["eval_tokens"]],
        "eval_loss": earlier["eval_loss"] + later["eval_loss"],
    }
