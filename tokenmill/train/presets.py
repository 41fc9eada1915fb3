"""Model shapes and training schedules for the models tokenmill ships.

A preset is data only: the ``transformers`` config arguments of the architecture
and the schedule that trained the committed weights.  Step counts are upper bounds
sized from the step time measured on an idle 2-core CPU; the committed runs also
pass a wall-clock budget (see docs/TRAINING.md and ``clock.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.train.reasoning_tasks import THINK_END, THINK_START

ARCHITECTURES = ("llama", "mixtral")


@dataclass(frozen=True)
class Phase:
    """A stretch of training at one sequence length and batch size."""

    steps: int
    seq_len: int
    batch_size: int

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"Phase.steps must be >= 0, got {self.steps}")
        if not 8 <= self.seq_len <= 2048:
            raise ValueError(f"Phase.seq_len must be in [8, 2048], got {self.seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"Phase.batch_size must be >= 1, got {self.batch_size}")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size


@dataclass(frozen=True)
class Schedule:
    """Optimiser and data schedule; the LR is warmup then cosine over all phases."""

    phases: tuple[Phase, ...]
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_windows: int = 16
    eval_seq_len: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("Schedule.phases must hold at least one Phase")
        if self.peak_lr <= 0:
            raise ValueError(f"Schedule.peak_lr must be > 0, got {self.peak_lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"Schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            raise ValueError(f"Schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.eval_every < 1:
            raise ValueError(f"Schedule.eval_every must be >= 1, got {self.eval_every}")

    @property
    def total_steps(self) -> int:
        return sum(phase.steps for phase in self.phases)


@dataclass(frozen=True)
class Preset:
    """An architecture, its config arguments and the schedule that trains it."""

    name: str
    architecture: str
    config: dict[str, Any]
    schedule: Schedule
    summary: str
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"Preset.architecture must be one of {ARCHITECTURES}, got {self.architecture!r}"
            )

    def with_steps(self, main_steps: int | None, final_steps: int | None) -> Preset:
        """This preset with the first and/or last phase's step count replaced."""
        phases = list(self.schedule.phases)
        if main_steps is not None:
            phases[0] = replace(phases[0], steps=main_steps)
        if final_steps is not None and len(phases) > 1:
            phases[-1] = replace(phases[-1], steps=final_steps)
        return replace(self, schedule=replace(self.schedule, phases=tuple(phases)))

    def with_schedule(self, **overrides: Any) -> Preset:
        """This preset with the given ``Schedule`` fields replaced (``None`` keeps a field).

        A continued stage passes a new ``seed`` so its batches are not the earlier
        stage's batches in the same order.
        """
        changes = {name: value for name, value in overrides.items() if value is not None}
        return replace(self, schedule=replace(self.schedule, **changes))


def _common_config(vocab_size: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }


def pycoder(vocab_size: int = 8192) -> Preset:
    config = _common_config(vocab_size) | {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "tie_word_embeddings": True,
    }
    schedule = Schedule(
        phases=(
            Phase(steps=1200, seq_len=512, batch_size=8),
            Phase(steps=50, seq_len=2048, batch_size=2),
        ),
        peak_lr=2e-3,
    )
    return Preset("pycoder", "llama", config, schedule, "Llama with GQA (8 query / 2 KV heads)")


def pycoder_draft(vocab_size: int = 8192) -> Preset:
    config = _common_config(vocab_size) | {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "tie_word_embeddings": True,
    }
    schedule = Schedule(
        phases=(
            Phase(steps=1000, seq_len=512, batch_size=8),
            Phase(steps=40, seq_len=2048, batch_size=2),
        ),
        peak_lr=3e-3,
    )
    return Preset(
        "pycoder-draft",
        "llama",
        config,
        schedule,
        "small Llama drafter for speculative decoding",
    )


def pycoder_moe(vocab_size: int = 8192) -> Preset:
    config = _common_config(vocab_size) | {
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": True,
    }
    schedule = Schedule(
        phases=(
            Phase(steps=800, seq_len=512, batch_size=8),
            Phase(steps=40, seq_len=2048, batch_size=2),
        ),
        peak_lr=2e-3,
    )
    return Preset("pycoder-moe", "mixtral", config, schedule, "Mixtral, 8 experts, top-2 routing")


def pyreason(vocab_size: int = 289) -> Preset:
    """A small chat model that thinks before it answers (train/reasoning_tasks.py).

    Its items are at most ~160 tokens, so it trains on 256-token windows and is scored
    and served at a 512-token context; the vocabulary is its own (digits one per token).
    """
    config = _common_config(vocab_size) | {
        "hidden_size": 192,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
    }
    schedule = Schedule(
        phases=(
            Phase(steps=4000, seq_len=256, batch_size=16),
            Phase(steps=60, seq_len=512, batch_size=8),
        ),
        peak_lr=2e-3,
        eval_every=200,
        eval_windows=32,
        eval_seq_len=256,
    )
    extra = {
        "data": "reasoning",
        "train_items": 120_000,
        "held_out_items": 1_200,
        # The model's own traces end each line with a newline, so a budget that
        # cuts a line short closes it with one before `</think>`.
        "generation_config": {"reasoning": {"start": THINK_START, "end": THINK_END,
                                            "bridge": "\n"}},
    }
    return Preset("pyreason", "llama", config, schedule,
                  "Llama that reasons in <think> before answering", extra)


PRESETS = {
    "pycoder": pycoder,
    "pycoder-draft": pycoder_draft,
    "pycoder-moe": pycoder_moe,
    "pyreason": pyreason,
}


def get_preset(name: str, vocab_size: int = 8192) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name](vocab_size)
