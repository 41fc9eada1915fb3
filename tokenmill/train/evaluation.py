"""Measurements of a trained model: held-out loss, expert load, greedy samples."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

# Prompts end where a token ends in real code ("):", '"""'), not in a newline or
# indentation: byte-level BPE merges a newline with the spaces after it, so a prompt
# that stops at a bare newline hands the model a token split it never saw in
# training (and it duly starts a new top-level statement).
SAMPLE_PROMPTS = (
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(path):",
    "class Stack:\n    def __init__(self):",
    'def is_prime(n):\n    """Return True if n is a prime number."""',
    "for i in range(10):",
)


@dataclass(frozen=True)
class HeldOutResult:
    """Mean next-token cross-entropy (nats) over ``num_tokens`` predicted tokens."""

    seq_len: int
    num_tokens: int
    loss: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


@torch.no_grad()
def held_out_loss(model: PreTrainedModel, windows: torch.Tensor, batch_size: int) -> HeldOutResult:
    """Token-weighted mean cross-entropy over ``windows`` ([num_windows, seq_len])."""
    was_training = model.training
    model.eval()
    total_loss = 0.0
    total_tokens = 0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]
        logits = model(input_ids=batch).logits.float()
        # Position t predicts token t+1; the last position has no target.
        per_token = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total_loss += float(per_token)
        total_tokens += batch[:, 1:].numel()
    model.train(was_training)
    return HeldOutResult(windows.shape[1], total_tokens, total_loss / total_tokens)


@torch.no_grad()
def expert_load(
    model: PreTrainedModel, windows: torch.Tensor, batch_size: int
) -> list[list[float]]:
    """Fraction of routed (token, slot) assignments each expert gets, per layer.

    Routing is recomputed from the router logits exactly as the model routes:
    the top ``num_experts_per_tok`` experts of each token's logits.
    """
    num_experts = model.config.num_local_experts
    top_k = model.config.num_experts_per_tok
    counts: torch.Tensor | None = None
    model.eval()
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]
        router_logits = model(input_ids=batch, output_router_logits=True).router_logits
        layer_counts = torch.stack(
            [
                torch.bincount(
                    logits.topk(top_k, dim=-1).indices.reshape(-1), minlength=num_experts
                )
                for logits in router_logits
            ]
        )
        counts = layer_counts if counts is None else counts + layer_counts
    assert counts is not None, "expert_load needs at least one window"
    fractions = counts.double() / counts.sum(dim=-1, keepdim=True)
    return fractions.tolist()


def imbalance_factor(fractions: list[float]) -> float:
    """max / mean of one layer's expert fractions (1.0 is perfectly balanced)."""
    return max(fractions) / (sum(fractions) / len(fractions))


@torch.no_grad()
def greedy_samples(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: tuple[str, ...] = SAMPLE_PROMPTS,
    max_new_tokens: int = 64,
) -> list[dict[str, str]]:
    """Greedy completions of ``prompts`` via ``generate(do_sample=False)``."""
    model.eval()
    samples = []
    for prompt in prompts:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
        completion = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=False)
        samples.append({"prompt": prompt, "completion": completion})
    return samples
