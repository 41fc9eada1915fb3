"""Supervised fine-tuning with a length penalty on the reasoning span (issue 19).

For a prompt x the data holds several completions y: here the verbose and the terse
trace of one program, which the task family draws with probabilities p(y|x) =
VERBOSE_PROBABILITY and 1 - VERBOSE_PROBABILITY. Penalising T(y), the tokens between
the thinking markers, by `alpha` per token, the policy that maximises

    E_pi[-alpha * T(y)] - KL(pi(.|x) || p(.|x))

is the data distribution tilted towards short thinking,
pi*(y|x) = p(y|x) exp(-alpha T(y)) / Z(x). Fine-tuning fits it by weighted maximum
likelihood: a completion's tokens weigh w(y|x) = p(y|x) exp(-alpha T(y)) / Z(x). A
prompt's weights sum to 1, so hard prompts (long thinking in every completion) count
as much as easy ones; only the choice between a prompt's completions moves. alpha = 0
is plain supervised fine-tuning on the data distribution (the control).

    loss = sum_i w_i sum_t m_it ce_it / sum_i w_i n_i

over a batch's sequences i, with m_it = 1 on completion tokens (the thinking, the
answer and the end of text; never the prompt) and n_i = sum_t m_it.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from tokenmill.train.reasoning_tasks import (
    ASSISTANT,
    LEVELS,
    THINK_END,
    THINK_START,
    USER,
    VERBOSE_PROBABILITY,
    generate_item,
)
from tokenmill.train.tokenizer import END_OF_TEXT, copy_tokenizer_files


@dataclass(frozen=True)
class Completion:
    text: str  # the assistant's part, up to and including the end of text
    data_probability: float  # p(y|x)
    thinking_tokens: int  # T(y)


@dataclass(frozen=True)
class PromptGroup:
    prompt: str  # the chat prompt up to the assistant's turn
    completions: tuple[Completion, ...]


def tilted_weights(completions: tuple[Completion, ...], alpha: float) -> list[float]:
    """w(y|x) = p(y|x) exp(-alpha T(y)) / Z(x): the prompt's completions' weights."""
    if alpha < 0:
        raise ValueError(f"length_penalty must be >= 0, got {alpha}")
    shortest = min(c.thinking_tokens for c in completions)  # exp() stays in range
    raw = [c.data_probability * math.exp(-alpha * (c.thinking_tokens - shortest))
           for c in completions]
    total = sum(raw)
    return [w / total for w in raw]


def length_penalized_loss(logits: torch.Tensor, input_ids: torch.Tensor,
                          completion_mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i w_i sum_t m_it ce_it / sum_i w_i n_i, where position t - 1's logits predict
    token t (logits [B, L, V], input_ids and completion_mask [B, L], weights [B])."""
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1),
        reduction="none").view(input_ids.shape[0], -1)
    mask = completion_mask[:, 1:].float()
    per_sequence = (ce * mask).sum(dim=1)
    return (weights * per_sequence).sum() / (weights * mask.sum(dim=1)).sum()


def prompt_groups(seed: int, count: int, tokenizer: PreTrainedTokenizerBase
                  ) -> list[PromptGroup]:
    """count programs (levels in turn), each with its verbose and terse completion."""
    groups = []
    for index in range(count):
        level = LEVELS[index % len(LEVELS)]
        variants = []
        for verbose in (True, False):
            # The same draws give the same program; only the trace's style differs.
            item = generate_item(random.Random(seed * 1_000_003 + index), level,
                                 1.0 if verbose else 0.0)
            thinking = len(tokenizer(item.thinking, add_special_tokens=False)["input_ids"])
            probability = VERBOSE_PROBABILITY if verbose else 1 - VERBOSE_PROBABILITY
            variants.append(Completion(item.completion + END_OF_TEXT, probability, thinking))
        groups.append(PromptGroup(f"{USER}\n{item.program}\n{ASSISTANT}\n", tuple(variants)))
    return groups


def batch_tensors(tokenizer: PreTrainedTokenizerBase, groups: list[PromptGroup], alpha: float,
                  pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, completion_mask, weights) for every completion of the groups, padded."""
    rows, masks, weights = [], [], []
    for group in groups:
        prompt_ids = tokenizer(group.prompt, add_special_tokens=False)["input_ids"]
        for completion, weight in zip(group.completions,
                                      tilted_weights(group.completions, alpha), strict=True):
            ids = tokenizer(completion.text, add_special_tokens=False)["input_ids"]
            rows.append(prompt_ids + ids)
            masks.append([0] * len(prompt_ids) + [1] * len(ids))
            weights.append(weight)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, row_mask) in enumerate(zip(rows, masks, strict=True)):
        input_ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = torch.tensor(row_mask)
    return input_ids, mask, torch.tensor(weights, dtype=torch.float32)


def finetune(model_dir: Path, out_dir: Path, alpha: float, steps: int,
             max_seconds: float | None = None, prompts_per_step: int = 16,
             peak_lr: float = 3e-4, warmup_steps: int = 20, seed: int = 7) -> dict:
    """Fine-tune model_dir with the length penalty alpha; write out_dir; the run's log."""
    torch.set_num_threads(2)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    groups = prompt_groups(seed, steps * prompts_per_step, tokenizer)
    pad_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    started, losses = time.perf_counter(), []
    for step in range(steps):
        if max_seconds is not None and time.perf_counter() - started > max_seconds:
            break
        for group in optimizer.param_groups:
            group["lr"] = peak_lr * min(1.0, (step + 1) / warmup_steps)
        chosen = groups[step * prompts_per_step:(step + 1) * prompts_per_step]
        input_ids, mask, weights = batch_tensors(tokenizer, chosen, alpha, pad_id)
        loss = length_penalized_loss(model(input_ids=input_ids).logits, input_ids, mask,
                                     weights)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    copy_tokenizer_files(model_dir, out_dir)
    (out_dir / "generation_config.json").write_bytes(
        (model_dir / "generation_config.json").read_bytes())
    return {"length_penalty": alpha, "steps": len(losses), "prompts_per_step": prompts_per_step,
            "peak_lr": peak_lr, "seed": seed, "train_seconds": time.perf_counter() - started,
            "loss": losses, "markers": [THINK_START, THINK_END]}
