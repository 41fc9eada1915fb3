"""Training an EAGLE-1 draft head (`tokenmill.speculative.eagle`) for a trained target model.

Data: the models' own corpus, split and packing (`corpus.py`, `packing.py`). Per
step, a batch of windows [B, T] goes through the target (transformers, no grad) for
its features f (final hidden states after the final norm); the head then runs
teacher-forced over the pairs (f_t + noise, x_{t+1}), t < T - 1, predicting
f_hat_{t+1}. The loss, with EAGLE-1's weights, is

    SmoothL1(f_hat_{t+1}, f_{t+1}) + 0.1 * CE(lm_head(f_hat_{t+1}), p_target(. | f_{t+1}))

The CE target is the target's whole next-token distribution, as in EAGLE-1's code,
not the corpus token: the head is scored on agreeing with the target, not with the
text. Input features get uniform noise U(-0.1, 0.1) (EAGLE-1's default), so the
head learns to continue from its own slightly-off predictions. AdamW with warmup and
cosine decay (`clock.py`), thread count chosen by measured speed (`threads.py`),
everything seeded.

Held-out measurements (`measure_eagle_head`): teacher-forced top-1 agreement of the
head's token with the target's greedy token at the next position, the first-draft
acceptance probability at temperature 1 (sum_x min(p, q)), and the greedy tokens per
target pass of real drafting (`EagleProposer`, k = 4) along the target's own greedy
continuations of held-out prompts.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, PreTrainedModel

from tokenmill.core.step import ProposalRequest
from tokenmill.model.loader import load_model, read_config
from tokenmill.sampling_params import SamplingParams
from tokenmill.speculative.base import Proposer
from tokenmill.speculative.eagle.checkpoint import (
    WEIGHTS_FILE,
    load_eagle_head,
    load_head_weights,
    read_head_config,
    save_eagle_head,
)
from tokenmill.speculative.eagle.head import EagleHead, head_arch
from tokenmill.speculative.eagle.proposer import EagleProposer
from tokenmill.train.clock import TrainingClock, learning_rate
from tokenmill.train.curve import plot_loss_curve
from tokenmill.train.eagle_card import render_eagle_card
from tokenmill.train.history import TrainHistory
from tokenmill.train.packing import evaluation_windows, pack_corpus, training_batches
from tokenmill.train.presets import Phase, Schedule
from tokenmill.train.threads import ThreadChooser
from tokenmill.train.tokenizer import END_OF_TEXT, load_tokenizer
from tokenmill.train.trainer import TRAIN_THREADS, make_optimizer


@dataclass(frozen=True)
class EagleRecipe:
    """How a head is trained and measured."""

    schedule: Schedule
    # Width of the uniform noise added to input features: U(-w/2, w/2).
    feature_noise: float = 0.2
    ce_weight: float = 0.1
    # Held-out windows (of the phase's seq_len) for the final teacher-forced metrics;
    # None: all of them.
    final_eval_windows: int | None = 128
    # Simulated drafting: prompts of prompt_len held-out tokens, continued greedily by
    # the target for continuation_len tokens, drafted draft_len tokens at a time.
    acceptance_prompts: int = 16
    prompt_len: int = 64
    continuation_len: int = 128
    draft_len: int = 4

    def __post_init__(self) -> None:
        if len(self.schedule.phases) != 1:
            raise ValueError("EagleRecipe.schedule must have exactly one phase")
        if self.feature_noise < 0:
            raise ValueError(f"EagleRecipe.feature_noise must be >= 0, got {self.feature_noise}")
        if self.ce_weight < 0:
            raise ValueError(f"EagleRecipe.ce_weight must be >= 0, got {self.ce_weight}")
        for name in ("acceptance_prompts", "prompt_len", "continuation_len", "draft_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"EagleRecipe.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def phase(self) -> Phase:
        return self.schedule.phases[0]

    def with_overrides(self, steps: int | None = None, seed: int | None = None) -> EagleRecipe:
        schedule = self.schedule
        if steps is not None:
            schedule = replace(schedule, phases=(replace(self.phase, steps=steps),))
        if seed is not None:
            schedule = replace(schedule, seed=seed)
        return replace(self, schedule=schedule)


# Sized for pycoder (h=256, 8192 tokens) on 2 busy cores: the committed run passes
# --max-minutes, which ends it earlier when the machine is slower.
PYCODER_RECIPE = EagleRecipe(
    Schedule(
        phases=(Phase(steps=2000, seq_len=256, batch_size=8),),
        peak_lr=2e-3,
        warmup_steps=30,
        eval_every=100,
        eval_windows=8,
        eval_seq_len=256,
    )
)


@dataclass
class HeadLoss:
    total: torch.Tensor
    regression: float
    cross_entropy: float
    # Positions where argmax(lm_head(f_hat)) == argmax(lm_head(f)), and positions scored.
    agreements: int
    positions: int
    # Sum over positions of sum_x min(p(x), q(x)) at temperature 1: the chance that
    # rejection sampling accepts the first draft (measured only outside training).
    overlap: float = 0.0


def head_loss(head: EagleHead, target: PreTrainedModel, windows: torch.Tensor,
              recipe: EagleRecipe, training: bool) -> HeadLoss:
    """The loss of the head over token windows [B, T] (teacher-forced); training adds
    the input noise, evaluation also measures the overlap of p and q."""
    with torch.no_grad():
        features = target.model(input_ids=windows).last_hidden_state
        target_logits = target.lm_head(features[:, 1:])
        target_probs = target_logits.float().softmax(-1)
        embeds = target.get_input_embeddings()(windows[:, 1:])
    inputs = features[:, :-1]
    if training and recipe.feature_noise:
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * recipe.feature_noise
    predicted = head.forward_windows(inputs, embeds)
    regression = F.smooth_l1_loss(predicted, features[:, 1:])
    logits = target.lm_head(predicted).float()
    cross_entropy = -(target_probs * logits.log_softmax(-1)).sum(-1).mean()
    agreements = int((logits.argmax(-1) == target_logits.argmax(-1)).sum())
    overlap = 0.0 if training else float(
        torch.minimum(target_probs, logits.detach().softmax(-1)).sum())
    return HeadLoss(regression + recipe.ce_weight * cross_entropy, float(regression.detach()),
                    float(cross_entropy.detach()), agreements, logits.shape[0] * logits.shape[1],
                    overlap)


@torch.no_grad()
def teacher_forced_metrics(head: EagleHead, target: PreTrainedModel, windows: torch.Tensor,
                           recipe: EagleRecipe, batch_size: int) -> dict:
    """Loss parts and top-1 agreement with the target over held-out windows."""
    was_training = head.training
    head.eval()
    total = regression = cross_entropy = 0.0
    agreements = positions = 0
    overlap = 0.0
    for start in range(0, windows.shape[0], batch_size):
        result = head_loss(head, target, windows[start:start + batch_size], recipe, training=False)
        weight = result.positions
        total += float(result.total) * weight
        regression += result.regression * weight
        cross_entropy += result.cross_entropy * weight
        agreements += result.agreements
        overlap += result.overlap
        positions += weight
    head.train(was_training)
    return {"loss": total / positions, "regression": regression / positions,
            "cross_entropy": cross_entropy / positions,
            "top1_agreement": agreements / positions,
            "sampled_acceptance": overlap / positions, "positions": positions,
            "seq_len": int(windows.shape[1])}


@torch.no_grad()
def greedy_continuations(target: PreTrainedModel, prompts: torch.Tensor, num_new: int
                         ) -> torch.Tensor:
    """[R, P + num_new]: each prompt followed by the target's greedy continuation
    (end-of-text does not stop it: the continuation is only scored as a trajectory)."""
    output = target(input_ids=prompts, use_cache=True)
    pieces = [prompts]
    for step in range(num_new):
        next_ids = output.logits[:, -1].argmax(-1, keepdim=True)
        pieces.append(next_ids)
        if step + 1 < num_new:
            output = target(input_ids=next_ids, cache=output.cache, use_cache=True)
    return torch.cat(pieces, dim=1)


@torch.no_grad()
def simulate_greedy_drafting(proposer: Proposer, target: PreTrainedModel,
                             sequences: torch.Tensor, prompt_len: int, draft_len: int) -> dict:
    """Speculative greedy decoding along known greedy sequences [R, L].

    Each verification pass drafts draft_len tokens, accepts the longest prefix that
    matches the sequence and emits one more (the target's own token), exactly as
    `verify_greedy` would; the proposer then observes the verified positions'
    features. Returns the mean tokens per target pass and the acceptance rate at
    each draft depth (given the previous draft was accepted).
    """
    features = target.model(input_ids=sequences).last_hidden_state
    rows, length = sequences.tolist(), sequences.shape[1]
    params = SamplingParams(temperature=0.0, max_tokens=length)
    live: list[tuple[ProposalRequest, int]] = []
    for index, row in enumerate(rows):
        # As after prefill: the prompt's positions are computed and one token sampled.
        request = ProposalRequest(f"eagle-sim-{index}", row[:prompt_len + 1], params, 0,
                                  draft_len)
        proposer.observe(request.request_id, 0, features[index, :prompt_len])
        live.append((request, index))
    accepted_counts: list[int] = []
    while live:
        for request, _ in live:
            if len(request.token_ids) + draft_len > length:
                proposer.release(request.request_id)
        live = [(r, i) for r, i in live if len(r.token_ids) + draft_len <= length]
        proposals = proposer.propose([r for r, _ in live])
        for (request, index), proposal in zip(live, proposals, strict=True):
            start = len(request.token_ids)
            upcoming = rows[index][start:]
            accepted = next((depth for depth, (drafted, actual)
                             in enumerate(zip(proposal.token_ids, upcoming, strict=False))
                             if drafted != actual), len(proposal.token_ids))
            accepted_counts.append(accepted)
            request.token_ids.extend(upcoming[:accepted + 1])
            proposer.observe(request.request_id, start - 1,
                             features[index, start - 1:start + accepted])
    passes = len(accepted_counts)
    reached = [sum(1 for a in accepted_counts if a >= depth) for depth in range(draft_len + 1)]
    return {"draft_len": draft_len, "passes": passes,
            "tokens_per_pass": (sum(accepted_counts) + passes) / max(1, passes),
            "acceptance_by_depth": [reached[d] / max(1, reached[d - 1])
                                    for d in range(1, draft_len + 1)]}


@dataclass
class _Stats:
    steps: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0
    steps_at_thread_count: dict[str, int] = field(default_factory=dict)


def _train_loop(head: EagleHead, target: PreTrainedModel, recipe: EagleRecipe,
                train_tokens: torch.Tensor, eval_windows: torch.Tensor, show_progress: bool,
                max_seconds: float | None) -> tuple[TrainHistory, _Stats]:
    schedule, phase = recipe.schedule, recipe.phase
    head.train()
    optimizer = make_optimizer(head, schedule)
    clock = TrainingClock(schedule, max_seconds)
    threads = ThreadChooser(choices=(TRAIN_THREADS, 1))
    history, stats = TrainHistory(), _Stats()
    batches = training_batches(train_tokens, phase.seq_len, phase.batch_size, schedule.seed)
    bar = tqdm(total=phase.steps, disable=not show_progress, mininterval=10, ascii=True)
    for step in range(phase.steps):
        if clock.main_budget_spent():
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, clock.progress(step, 0, step), schedule)
        threads.threads_for_step(step)
        started = time.perf_counter()
        result = head_loss(head, target, next(batches), recipe, training=True)
        result.total.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), schedule.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        threads.record(time.perf_counter() - started, phase.tokens_per_step)
        stats.steps += 1
        stats.tokens_seen += phase.tokens_per_step
        history.steps.append(stats.steps)
        history.tokens.append(stats.tokens_seen)
        loss = float(result.total.detach())
        history.train_loss.append(loss)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}",
                        agree=f"{result.agreements / result.positions:.3f}")
        if stats.steps % schedule.eval_every == 0:
            torch.set_num_threads(threads.current)
            metrics = teacher_forced_metrics(head, target, eval_windows, recipe,
                                             phase.batch_size)
            history.eval_steps.append(stats.steps)
            history.eval_tokens.append(stats.tokens_seen)
            history.eval_loss.append(metrics["loss"])
            bar.write(f"step {stats.steps}: held-out loss {metrics['loss']:.4f}, "
                      f"top-1 agreement {metrics['top1_agreement']:.3f}")
    bar.close()
    stats.train_seconds = clock.elapsed()
    stats.steps_at_thread_count = {str(n): c for n, c in threads.steps_at.items()}
    torch.set_num_threads(threads.current)
    return history, stats


def target_record(target_dir: Path) -> dict:
    """Which target a head was trained for: name, shape and a hash of its weights."""
    arch = read_config(target_dir)
    digest = hashlib.sha256()
    for path in sorted(target_dir.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return {"name": target_dir.resolve().name, "architecture": arch.architecture,
            "num_layers": arch.num_layers, "weights_sha256": digest.hexdigest()}


def measure_eagle_head(head_dir: Path, target_dir: Path, target: PreTrainedModel,
                       held_out_tokens: torch.Tensor, recipe: EagleRecipe) -> tuple[dict, dict]:
    """The saved head's held-out teacher-forced metrics and simulated greedy drafting
    (through `load_eagle_head` and `EagleProposer`, as the engine would use it)."""
    drafting_target = load_model(target_dir, dtype="float32", device="cpu", progress=False).model
    head = load_eagle_head(head_dir, drafting_target)
    phase = recipe.phase
    final_windows = evaluation_windows(held_out_tokens, phase.seq_len, recipe.final_eval_windows)
    held_out = teacher_forced_metrics(head, target, final_windows, recipe, phase.batch_size)
    prompts = evaluation_windows(held_out_tokens, recipe.prompt_len, recipe.acceptance_prompts)
    sequences = greedy_continuations(target, prompts, recipe.continuation_len)
    blocks_per_sequence = -(-(sequences.shape[1] + recipe.draft_len) // 16)
    proposer = EagleProposer(head, drafting_target, num_blocks=len(prompts) * blocks_per_sequence)
    acceptance = simulate_greedy_drafting(proposer, target, sequences, recipe.prompt_len,
                                          recipe.draft_len)
    acceptance |= {"prompts": len(prompts), "prompt_len": recipe.prompt_len,
                   "continuation_len": recipe.continuation_len}
    return held_out, acceptance


def train_eagle_head(target_dir: Path, out_dir: Path, train_texts: list[str],
                     held_out_texts: list[str], recipe: EagleRecipe = PYCODER_RECIPE,
                     show_progress: bool = True, max_seconds: float | None = None,
                     init_from: Path | None = None) -> dict:
    """Train a head for the target in target_dir and write it (with its measurements,
    loss curve and train log) to out_dir; returns the train log.

    init_from: start from this saved head instead of random weights (e.g. the head of
    an earlier version of the same target, after the target was trained further).
    """
    torch.set_num_threads(TRAIN_THREADS)
    schedule = recipe.schedule
    tokenizer = load_tokenizer(target_dir)
    corpus = pack_corpus(tokenizer.backend_tokenizer, tokenizer.convert_tokens_to_ids(END_OF_TEXT),
                         train_texts, held_out_texts, schedule.eval_seq_len,
                         schedule.eval_windows)
    train_tokens, held_out_tokens, eval_windows = (corpus.train, corpus.held_out,
                                                   corpus.eval_windows)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    target.eval().requires_grad_(False)
    arch = read_config(target_dir)

    torch.manual_seed(schedule.seed)
    head = EagleHead(head_arch(arch), arch.max_position_embeddings)
    head.init_weights()
    init_record = None
    if init_from is not None:
        _, init_config = read_head_config(init_from, arch)
        load_head_weights(head, load_file(str(init_from / WEIGHTS_FILE)), init_from)
        init_record = init_config["target"]
    history, stats = _train_loop(head, target, recipe, train_tokens, eval_windows,
                                 show_progress, max_seconds)
    save_eagle_head(head, out_dir, target_record(target_dir))

    held_out, acceptance = measure_eagle_head(out_dir, target_dir, target, held_out_tokens,
                                              recipe)

    log = {
        "target": target_record(target_dir),
        "recipe": asdict(recipe),
        # The target record of the head this one continued from (None: random init).
        "init_from": init_record,
        "num_parameters": sum(p.numel() for p in head.parameters()),
        "train_tokens_in_corpus": int(train_tokens.numel()),
        "held_out_tokens_in_corpus": int(held_out_tokens.numel()),
        **asdict(stats),
        "max_seconds": max_seconds,
        "tokens_per_second": stats.tokens_seen / max(stats.train_seconds, 1e-9),
        "torch_threads": TRAIN_THREADS,
        "torch_version": torch.__version__,
        "final_train_loss": history.train_loss[-1] if history.train_loss else None,
        "held_out": held_out,
        "acceptance": acceptance,
        "history": asdict(history),
    }
    (out_dir / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    plot_loss_curve(history, f"EAGLE head for {log['target']['name']}",
                    out_dir / "loss_curve.png", ylabel=f"SmoothL1 + {recipe.ce_weight:g} CE")
    weights_bytes = (out_dir / WEIGHTS_FILE).stat().st_size
    (out_dir / "README.md").write_text(render_eagle_card(log, weights_bytes))
    return log
