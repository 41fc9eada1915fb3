"""Extending a trained code model to long context (issue 18's pycoder-long).

Continues a model's weights with a larger RoPE base (the "adjusted base frequency"
recipe of Code Llama and its successors: raising theta slows every rotary frequency,
so positions far beyond the trained length rotate no further than the old ones did)
and trains through phases of growing sequence length on a mix of

- task rows: one long-context item (`longctx_tasks`: needle, multi-key, multi-value,
  code) of a random length up to the phase's, its answer appended, the rest of the
  row filled with a code window after an end of text;
- code rows: plain windows of the training files, so the model keeps writing code.

    loss = mean_t ce_t + answer_weight * (sum_t m_t ce_t / sum_t m_t)

over a batch's tokens, with m_t = 1 on answer tokens: an answer is a few tokens of a
row of thousands, and without the second term the task would weigh almost nothing.

Training items draw their filler (and the `code` kind its files) from the training
files, with seeds from TRAIN_SEED_BASE; evaluation items use the held-out files and
seeds from 0, so no evaluated context was trained on.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tokenmill.train.evaluation import held_out_loss
from tokenmill.train.longctx_tasks import KINDS, LongContextItem, make_item, make_items, score
from tokenmill.train.packing import evaluation_windows
from tokenmill.train.tokenizer import END_OF_TEXT, copy_tokenizer_files, load_tokenizer

TRAIN_SEED_BASE = 1_000_000
SEED_STRIDE = 100_000  # item seeds of recipe seed s: BASE + s * STRIDE + 1, 2, ...
FACT = re.compile(r"^KEY_(\w+) = (\d+)$", re.MULTILINE)  # a planted multi-key fact
EVAL_MAX_TOKENS = 24  # the longest answer (three values of multi-value) fits


@dataclass(frozen=True)
class LongPhase:
    steps: int
    seq_len: int
    batch_size: int
    time_share: float  # of max_seconds, when the run has a wall-clock budget


@dataclass(frozen=True)
class LongContextRecipe:
    # Short rows first: many items per step while the model learns to look things up.
    phases: tuple[LongPhase, ...] = (
        LongPhase(300, 512, 8, 0.25),
        LongPhase(250, 2048, 2, 0.30),
        LongPhase(100, 4096, 1, 0.15),
        LongPhase(60, 8192, 1, 0.30),
    )
    rope_theta: float = 160_000.0
    max_position_embeddings: int = 8192
    peak_lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    task_share: float = 0.75  # of rows
    answer_weight: float = 1.0
    # After a multi-key item's answer, ask up to this many of its other planted keys
    # (`assert KEY_<b> == <value>` lines, every value an answer): several lookups per
    # context, as in associative-recall training (MQAR), instead of one per row.
    extra_questions: int = 0
    kind_weights: tuple[float, ...] = (1.0,) * len(KINDS)  # of task rows, in KINDS order
    seed: int = 0

    def __post_init__(self) -> None:
        if self.extra_questions < 0:
            raise ValueError(f"extra_questions must be >= 0, got {self.extra_questions}")
        check_kind_weights(self.kind_weights)

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)


def check_kind_weights(weights: tuple[float, ...]) -> None:
    """ValueError unless `weights` holds one weight >= 0 per kind, not all zero."""
    if len(weights) != len(KINDS) or min(weights) < 0 or not sum(weights):
        raise ValueError(f"kind_weights: {len(KINDS)} weights >= 0 ({', '.join(KINDS)}), "
                         f"not all zero, got {weights}")


def answer_text(item: LongContextItem) -> str:
    """What follows the prompt in a training row: the answer and the line's end (a
    space first where the prompt ends at `==`)."""
    return ("" if item.prompt.endswith("[") else " ") + item.answer + "\n"


class RowMaker:
    """Training rows of one length: token ids [seq_len] and answer masks [seq_len]."""

    def __init__(self, tokenizer, texts: list[str], code_tokens: torch.Tensor,
                 recipe: LongContextRecipe) -> None:
        self.backend = tokenizer.backend_tokenizer
        self.eot = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
        self.texts = texts
        self.code = code_tokens
        self.recipe = recipe
        self.rng = random.Random(recipe.seed)
        self.items = 0

    @property
    def item_seed(self) -> int:
        """The current item's seed: a stage with another recipe seed draws other
        items (other names and values), not the earlier stage's again."""
        return TRAIN_SEED_BASE + self.recipe.seed * SEED_STRIDE + self.items

    def count(self, text: str) -> int:
        return len(self.backend.encode(text, add_special_tokens=False).ids)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def code_window(self, length: int) -> list[int]:
        start = self.rng.randrange(0, self.code.numel() - length)
        return self.code[start:start + length].tolist()

    def row(self, seq_len: int) -> tuple[list[int], list[int], str | None]:
        """(ids, answer mask, the item's kind or None for a code row)."""
        if self.rng.random() >= self.recipe.task_share:
            return self.code_window(seq_len), [0] * seq_len, None
        weights = self.recipe.kind_weights
        kind = (self.rng.choice(KINDS) if len(set(weights)) == 1  # the earlier stages' draw
                else self.rng.choices(KINDS, weights=weights)[0])
        length = self.rng.randint(max(128, seq_len // 8), seq_len - 64)
        self.items += 1
        try:
            item = make_item(kind, self.item_seed, self.texts, length,
                             self.count, distractors=self.rng.randint(2, 16),
                             values=self.rng.randint(2, 4))
        except ValueError:  # a `code` item with no usable file at this length
            return self.code_window(seq_len), [0] * seq_len, None
        prompt, answer = self.encode(item.prompt), self.encode(answer_text(item))
        if len(prompt) + len(answer) >= seq_len:  # the item ran long: no cut answers
            return self.code_window(seq_len), [0] * seq_len, None
        ids, mask = prompt + answer, [0] * len(prompt) + [1] * len(answer)
        if kind == "multi-key":
            for question, value in self.extra_lookups(item):
                if len(ids) + len(question) + len(value) >= seq_len:
                    break
                ids += question + value
                mask += [0] * len(question) + [1] * len(value)
        ids, mask = ids + [self.eot], mask + [0]
        fill = seq_len - len(ids)
        return ids + self.code_window(fill), mask + [0] * fill, kind

    def extra_lookups(self, item: LongContextItem) -> list[tuple[list[int], list[int]]]:
        """(question ids, answer ids) for up to `extra_questions` of the item's other
        planted keys, in random order."""
        facts = FACT.findall(item.prompt)
        asked = item.prompt.rsplit("KEY_", 1)[1].split(" ", 1)[0]
        others = [(name, value) for name, value in facts if name != asked]
        self.rng.shuffle(others)
        return [(self.encode(f"assert KEY_{name} =="), self.encode(f" {value}\n"))
                for name, value in others[:self.recipe.extra_questions]]

    def batch(self, seq_len: int, batch_size: int
              ) -> tuple[torch.Tensor, torch.Tensor, list[str | None]]:
        rows = [self.row(seq_len) for _ in range(batch_size)]
        return (torch.tensor([r[0] for r in rows]),
                torch.tensor([r[1] for r in rows], dtype=torch.float32), [r[2] for r in rows])


def weighted_loss(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor,
                  answer_weight: float) -> tuple[torch.Tensor, float, list[float]]:
    """(loss to minimise, answer-token cross-entropy, the same per row: nan where a row
    has no answer) of one batch."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           ids[:, 1:].reshape(-1), reduction="none")
    answer_mask = mask[:, 1:].reshape(-1)
    answers = answer_mask.sum()
    answer_ce = (ce * answer_mask).sum() / answers.clamp(min=1)
    loss = ce.mean() + (answer_weight * answer_ce if answers > 0 else 0.0)
    row_mask = mask[:, 1:]
    per_row = ((ce.detach().view_as(row_mask) * row_mask).sum(1) / row_mask.sum(1)).tolist()
    return loss, float(answer_ce.detach()) if answers > 0 else math.nan, per_row


def _recent(history: list[dict], steps: int) -> str:
    """Mean answer cross-entropy per kind over the last `steps` steps, as text."""
    pooled: dict[str, list[float]] = {}
    for entry in history[-steps:]:
        for kind, ce in entry.get("answer_ce_by_kind", {}).items():
            pooled.setdefault(kind, []).append(ce)
    return ", ".join(f"{kind} {sum(v) / len(v):.2f}" for kind, v in sorted(pooled.items()))


def _learning_rate(step: int, progress: float, recipe: LongContextRecipe) -> float:
    warmup = min(1.0, (step + 1) / recipe.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return recipe.peak_lr * warmup * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * cosine)


def extend_context(model: PreTrainedModel, recipe: LongContextRecipe) -> None:
    """Set the larger RoPE base and context length (the rotary tables follow)."""
    config = model.config
    config.rope_parameters = {**config.rope_parameters, "rope_theta": recipe.rope_theta}
    config.max_position_embeddings = recipe.max_position_embeddings
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)


def train_long_context(init_from: Path, out_dir: Path, train_texts: list[str],
                       held_out_texts: list[str], recipe: LongContextRecipe,
                       max_seconds: float | None = None, log_every: int = 10) -> dict:
    """Continue `init_from` per `recipe`, write the model to `out_dir`, return the log."""
    torch.manual_seed(recipe.seed)
    tokenizer = load_tokenizer(init_from)
    model = AutoModelForCausalLM.from_pretrained(str(init_from), dtype=torch.float32)
    extend_context(model, recipe)
    eot = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    code = torch.tensor([t for text in train_texts for t in
                         tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
                         + [eot]])
    held_out = torch.tensor([t for text in held_out_texts for t in
                             tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
                         + [eot]])
    before = _held_out(model, held_out)
    rows = RowMaker(tokenizer, train_texts, code, recipe)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}],
                                  lr=recipe.peak_lr, betas=(0.9, 0.95))
    model.train()
    history: list[dict] = []
    started, step, phase_seconds, phase_steps = time.perf_counter(), 0, [], []
    for phase in recipe.phases:
        phase_started, done = time.perf_counter(), 0
        budget = None if max_seconds is None else max_seconds * phase.time_share
        for _ in range(phase.steps):
            if budget is not None and time.perf_counter() - phase_started > budget:
                break
            by_time = 0.0 if max_seconds is None else (time.perf_counter() - started) / max_seconds
            progress = max(step / recipe.total_steps, by_time)
            for group in optimizer.param_groups:
                group["lr"] = _learning_rate(step, progress, recipe)
            ids, mask, kinds = rows.batch(phase.seq_len, phase.batch_size)
            loss, answer_ce, per_row = weighted_loss(model, ids, mask, recipe.answer_weight)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step, done = step + 1, done + 1
            by_kind = {kind: ce for kind, ce in zip(kinds, per_row, strict=True) if kind}
            history.append({"step": step, "seq_len": phase.seq_len,
                            "loss": float(loss.detach()), "answer_ce": answer_ce,
                            "answer_ce_by_kind": by_kind})
            if step % log_every == 0:
                print(f"step {step} seq {phase.seq_len}: loss {float(loss.detach()):.3f}, "
                      f"answer ce {_recent(history, log_every * 3)} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
        phase_seconds.append(time.perf_counter() - phase_started)
        phase_steps.append(done)
    model.eval()
    after = _held_out(model, held_out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    copy_tokenizer_files(init_from, out_dir)
    _set_tokenizer_length(out_dir, recipe.max_position_embeddings)
    stage = {"recipe": asdict(recipe), "max_seconds": max_seconds,
             "phase_steps": phase_steps, "phase_seconds": phase_seconds,
             "train_seconds": time.perf_counter() - started}
    # Continuing an extended model: its stages and curve come first.
    earlier = (json.loads((init_from / "longctx_log.json").read_text())
               if (init_from / "longctx_log.json").is_file() else None)
    offset = earlier["history"][-1]["step"] if earlier and earlier["history"] else 0
    log = {"init_from": earlier["init_from"] if earlier else str(init_from),
           "stages": (earlier["stages"] if earlier else []) + [stage],
           "torch_version": torch.__version__,
           "held_out_before": earlier["held_out_before"] if earlier else before,
           "held_out_after": after,
           "history": (earlier["history"] if earlier else [])
           + [{**h, "step": h["step"] + offset} for h in history]}
    (out_dir / "longctx_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def _held_out(model: PreTrainedModel, tokens: torch.Tensor, windows: int = 8) -> dict:
    """Held-out perplexity at 2048 tokens and at the model's context (a spread of
    `windows` windows; a length the held-out text cannot fill is skipped)."""
    longest = model.config.max_position_embeddings
    results = {}
    with torch.no_grad():
        for length in sorted({min(2048, longest), longest}):
            if length > tokens.numel():
                continue
            result = held_out_loss(model, evaluation_windows(tokens, length, windows), 1)
            results[str(length)] = {"loss": result.loss, "perplexity": result.perplexity}
    return results


def _set_tokenizer_length(out_dir: Path, length: int) -> None:
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["model_max_length"] = length
    path.write_text(json.dumps(config, indent=1) + "\n")


def task_accuracy(llm, texts: list[str], lengths: tuple[int, ...], per_kind: int,
                  kinds: tuple[str, ...] = KINDS) -> dict:
    """{kind: {length: fraction correct}} of greedy completions of held-out items
    (seeds 0 .. per_kind - 1) through a tokenmill `LLM`."""
    from tokenmill.sampling_params import SamplingParams

    def count(text: str) -> int:
        return len(llm.engine.encode(text))

    params = SamplingParams(temperature=0, max_tokens=EVAL_MAX_TOKENS)
    results: dict[str, dict[str, float]] = {}
    for kind in kinds:
        for length in lengths:
            items = make_items(kind, per_kind, 0, texts, length, count)
            outputs = llm.generate([item.prompt for item in items], params)
            right = sum(score(item, out.outputs[0].text)
                        for item, out in zip(items, outputs, strict=True))
            results.setdefault(kind, {})[str(length)] = right / len(items)
    return results
