"""A training run's loss history (what the trainers record and the loss curve plots)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainHistory:
    """Per-step training loss and periodic held-out loss, keyed by tokens seen."""

    steps: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_tokens: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
