"""Training a decoder-only model from random initialisation on packed windows.

One run walks the phases of a :class:`Schedule` (for example most steps at 512
tokens, then a short phase at 2048 so the model has seen full-length positions),
with AdamW and a warmup + cosine learning rate over all steps.  Everything random
is seeded: the weights through ``torch.manual_seed`` and the batch order through
the packing generator, so a rerun on the same machine and corpus repeats the
run.  The output directory is a standard Hugging Face model directory.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
)

from tokenmill.train.clock import TrainingClock, learning_rate
from tokenmill.train.curve import plot_loss_curve
from tokenmill.train.evaluation import held_out_loss
from tokenmill.train.history import TrainHistory
from tokenmill.train.packing import evaluation_windows, pack_corpus, training_batches
from tokenmill.train.presets import Preset, Schedule
from tokenmill.train.threads import ThreadChooser
from tokenmill.train.tokenizer import END_OF_TEXT, copy_tokenizer_files, load_tokenizer
from tokenmill.train.trainlog import STAGE_KEYS, continue_history, stages_of

TRAIN_THREADS = 2
FINAL_EVAL_SEQ_LENS = (512, 2048)


def build_model(preset: Preset) -> PreTrainedModel:
    """A randomly initialised model of the preset's shape (seed first for repeatability)."""
    if preset.architecture == "llama":
        return LlamaForCausalLM(LlamaConfig(**preset.config))
    return MixtralForCausalLM(MixtralConfig(**preset.config))


def make_optimizer(model: PreTrainedModel, schedule: Schedule) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms' gains)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": schedule.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=schedule.peak_lr, betas=(schedule.beta1, schedule.beta2))


def _cross_entropy_of(output, model: PreTrainedModel) -> torch.Tensor:
    """The language-model part of the loss (MoE losses also carry the router term)."""
    aux_loss = getattr(output, "aux_loss", None)
    if aux_loss is None:
        return output.loss
    return output.loss - model.config.router_aux_loss_coef * aux_loss


@dataclass
class RunStats:
    """What one pass over the schedule did, for the train log."""

    steps: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0
    phase_steps: list[int] = field(default_factory=list)
    phase_seconds: list[float] = field(default_factory=list)
    steps_at_thread_count: dict[str, int] = field(default_factory=dict)


def train_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    grad_clip: float,
) -> float:
    """One optimiser step on ``batch``; returns its language-model cross-entropy."""
    is_moe = getattr(model.config, "num_local_experts", None) is not None
    # MoE training adds the load-balancing term, which needs the router logits.
    extra = {"output_router_logits": True} if is_moe else {}
    output = model(input_ids=batch, labels=batch, **extra)
    output.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(_cross_entropy_of(output, model).detach())


def run_schedule(
    model: PreTrainedModel,
    schedule: Schedule,
    train_tokens: torch.Tensor,
    eval_windows: torch.Tensor,
    show_progress: bool,
    max_seconds: float | None,
) -> tuple[TrainHistory, RunStats]:
    """Train ``model`` through every phase of ``schedule``."""
    model.train()
    optimizer = make_optimizer(model, schedule)
    clock = TrainingClock(schedule, max_seconds)
    threads = ThreadChooser(choices=(TRAIN_THREADS, 1))
    history = TrainHistory()
    stats = RunStats()
    bar = tqdm(
        total=schedule.total_steps,
        disable=not show_progress,
        mininterval=20,
        ascii=True,
    )
    for phase_index, phase in enumerate(schedule.phases):
        phase_started = time.perf_counter()
        if clock.is_final_phase(phase_index):
            clock.enter_final_phase(clock.progress(stats.steps, phase_index - 1, 0))
        batches = training_batches(
            train_tokens, phase.seq_len, phase.batch_size, schedule.seed + phase_index
        )
        steps_done = 0
        for step_in_phase in range(phase.steps):
            if not clock.is_final_phase(phase_index) and clock.main_budget_spent():
                break
            progress = clock.progress(stats.steps, phase_index, step_in_phase)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(stats.steps, progress, schedule)
            batch = next(batches)
            threads.threads_for_step(stats.steps)
            step_started = time.perf_counter()
            loss = train_step(model, optimizer, batch, schedule.grad_clip)
            threads.record(time.perf_counter() - step_started, phase.tokens_per_step)
            steps_done += 1
            stats.steps += 1
            stats.tokens_seen += phase.tokens_per_step
            history.steps.append(stats.steps)
            history.tokens.append(stats.tokens_seen)
            history.train_loss.append(loss)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", seq=phase.seq_len)
            if stats.steps % schedule.eval_every == 0:
                torch.set_num_threads(threads.current)
                result = held_out_loss(model, eval_windows, phase.batch_size)
                history.eval_steps.append(stats.steps)
                history.eval_tokens.append(stats.tokens_seen)
                history.eval_loss.append(result.loss)
                bar.write(f"step {stats.steps}: held-out loss {result.loss:.4f}")
        stats.phase_seconds.append(time.perf_counter() - phase_started)
        stats.phase_steps.append(steps_done)
    bar.close()
    stats.train_seconds = clock.elapsed()
    stats.steps_at_thread_count = {str(n): c for n, c in threads.steps_at.items()}
    # Measurements after training use whichever thread count was fastest last.
    torch.set_num_threads(threads.current)
    return history, stats


def final_held_out(model: PreTrainedModel, held_out_tokens: torch.Tensor) -> dict:
    """Loss and perplexity over all held-out windows at each reported context length."""
    results = {}
    # A model trained for a shorter context is scored at that context only.
    longest = model.config.max_position_embeddings
    for seq_len in sorted({min(n, longest) for n in FINAL_EVAL_SEQ_LENS}):
        windows = evaluation_windows(held_out_tokens, min(seq_len, held_out_tokens.numel()), None)
        result = held_out_loss(model, windows, max(1, 4096 // windows.shape[1]))
        results[str(result.seq_len)] = {
            "loss": result.loss,
            "perplexity": result.perplexity,
            "tokens": result.num_tokens,
        }
    return results


def train_model(
    preset: Preset,
    tokenizer_dir: Path,
    out_dir: Path,
    train_texts: list[str],
    held_out_texts: list[str],
    show_progress: bool = True,
    max_seconds: float | None = None,
    init_from: Path | None = None,
) -> dict:
    """Train ``preset`` and write a loadable model directory; returns the train log.

    ``max_seconds`` caps the wall time of the training loop (see ``TrainingClock``);
    without it the run takes exactly the schedule's steps.  ``init_from`` continues
    from a model directory this trainer wrote, as a new stage of its log.
    """
    torch.set_num_threads(TRAIN_THREADS)
    schedule = preset.schedule
    tokenizer = load_tokenizer(tokenizer_dir)
    corpus = pack_corpus(tokenizer.backend_tokenizer, tokenizer.convert_tokens_to_ids(END_OF_TEXT),
                         train_texts, held_out_texts, schedule.eval_seq_len,
                         schedule.eval_windows)
    train_tokens, held_out_tokens, eval_windows = (corpus.train, corpus.held_out,
                                                   corpus.eval_windows)

    torch.manual_seed(schedule.seed)
    if init_from is None:
        model, earlier = build_model(preset), None
    else:
        model, earlier = load_for_continuation(preset, init_from)
    history, stats = run_schedule(
        model, schedule, train_tokens, eval_windows, show_progress, max_seconds
    )
    held_out = final_held_out(model, held_out_tokens)
    save_model_dir(model, tokenizer_dir, out_dir, preset.extra.get("generation_config"))

    stage = stage_record(stats, schedule, max_seconds, continued=earlier is not None)
    stages = ([] if earlier is None else stages_of(earlier)) + [stage]
    curve = asdict(history)
    if earlier is not None:
        curve = continue_history(earlier["history"], curve)
    total_tokens = sum(s["tokens_seen"] for s in stages)
    total_seconds = sum(s["train_seconds"] for s in stages)
    log = {
        "preset": preset.name,
        "architecture": preset.architecture,
        "model_class": type(model).__name__,
        "config": preset.config,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens_in_corpus": int(train_tokens.numel()),
        "held_out_tokens_in_corpus": int(held_out_tokens.numel()),
        "steps": sum(s["steps"] for s in stages),
        "tokens_seen": total_tokens,
        "train_seconds": total_seconds,
        "epochs": total_tokens / train_tokens.numel(),
        "tokens_per_second": total_tokens / total_seconds,
        "torch_threads": TRAIN_THREADS,
        "torch_version": torch.__version__,
        "final_train_loss": history.train_loss[-1] if history.train_loss else None,
        "held_out": held_out,
        "stages": stages,
        "history": curve,
    }
    (out_dir / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    plot_loss_curve(TrainHistory(**curve), preset.name, out_dir / "loss_curve.png")
    return log


def stage_record(
    stats: RunStats, schedule: Schedule, max_seconds: float | None, continued: bool
) -> dict:
    """One entry of the log's ``"stages"``: this run's schedule and timings."""
    record = {key: value for key, value in asdict(stats).items() if key in STAGE_KEYS}
    record["init"] = "continued" if continued else "random"
    record["schedule"] = asdict(schedule)
    record["max_seconds"] = max_seconds
    return record


def load_for_continuation(preset: Preset, model_dir: Path) -> tuple[PreTrainedModel, dict]:
    """The saved model in ``model_dir`` and its train log, checked against ``preset``."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    expected = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}[preset.architecture]
    if type(model).__name__ != expected:
        raise ValueError(f"{model_dir} holds a {type(model).__name__}, preset needs {expected}")
    earlier = json.loads((model_dir / "train_log.json").read_text())
    return model, earlier


def save_model_dir(model: PreTrainedModel, tokenizer_dir: Path, out_dir: Path,
                   generation_extra: dict | None = None) -> None:
    """Write config.json, model.safetensors, generation_config.json (with the preset's
    extra entries, such as a reasoning model's markers) and tokenizer files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.config
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        **(generation_extra or {}),
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    copy_tokenizer_files(tokenizer_dir, out_dir)
