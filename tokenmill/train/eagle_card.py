"""The README.md of a trained EAGLE head, rendered from its train log."""

from __future__ import annotations

import platform

from tokenmill.train.corpus import HELD_OUT_BUCKETS


def _thread_counts(steps_at: dict[str, int]) -> str:
    return ", ".join(f"{steps} at {threads}" for threads, steps in steps_at.items())


def render_eagle_card(log: dict, weights_bytes: int) -> str:
    """Card text: what the head is, its data, its training and its held-out numbers."""
    parts = (_description_lines(log) + _training_lines(log) + _evaluation_lines(log)
             + _footer_lines(log, weights_bytes))
    return "\n".join(parts)


def _description_lines(log: dict) -> list[str]:
    target = log["target"]
    return [
        f"# EAGLE-1 draft head for {target['name']}",
        "",
        f"A {log['num_parameters'] / 1e6:.2f}M-parameter draft head for speculative decoding "
        f"with `{target['name']}` in tokenmill (`tokenmill.speculative.eagle`): FC(2h -> h) over "
        "[target feature f_t ; embedding of x_{t+1}], then one Llama decoder layer, "
        "predicting the target's next feature f_{t+1}; the target's own embedding and LM "
        "head are shared and not stored here. Trained for the target weights with SHA-256 "
        f"`{target['weights_sha256'][:16]}...`.",
        "",
        "```python",
        "from tokenmill.speculative.eagle.checkpoint import load_eagle_head",
        "from tokenmill.speculative.eagle.proposer import EagleProposer",
        "proposer = EagleProposer(load_eagle_head(head_dir, target_model), target_model, num_blocks)",
        "```",
        "",
        "## Training data",
        "",
        f"The target's own corpus: the `.py` files of the CPython {platform.python_version()} "
        "standard library (tests and build dumps excluded), one `<|endoftext|>` after each "
        f"file; files whose path's SHA-256 falls in bucket 0 of {HELD_OUT_BUCKETS} are held "
        f"out: {log['train_tokens_in_corpus']:,} training tokens, "
        f"{log['held_out_tokens_in_corpus']:,} held-out tokens. The target's features (final "
        "hidden states after the final norm) are computed on the fly for each batch.",
        "",
    ]


def _training_lines(log: dict) -> list[str]:
    recipe = log["recipe"]
    schedule = recipe["schedule"]
    phase = schedule["phases"][0]
    start = ("random initialisation" if log.get("init_from") is None else
             "the head trained for the earlier target weights with SHA-256 "
             f"`{log['init_from']['weights_sha256'][:16]}...`")
    budget = (f" (wall-clock cap {log['max_seconds'] / 60:.0f} min)"
              if log.get("max_seconds") else "")
    return [
        "## Training",
        "",
        f"Loss SmoothL1(f_hat, f) + {recipe['ce_weight']} x CE(LM head(f_hat), the target's "
        "next-token distribution) (EAGLE-1's weights), teacher-forced, with uniform noise "
        f"U(-{recipe['feature_noise'] / 2:g}, {recipe['feature_noise'] / 2:g}) on input "
        f"features, starting from {start}. {log['steps']} steps of {phase['batch_size']} windows x {phase['seq_len']} "
        f"tokens (of {phase['steps']} planned{budget}); {log['tokens_seen']:,} tokens in "
        f"{log['train_seconds'] / 60:.1f} min ({log['tokens_per_second']:.0f} tokens/s) on a "
        "2-core CPU shared with other work, at low priority. AdamW (betas "
        f"{schedule['beta1']}, {schedule['beta2']}, weight decay {schedule['weight_decay']} on "
        f"matrices), peak LR {schedule['peak_lr']} after {schedule['warmup_steps']} warmup "
        f"steps, cosine decay to {schedule['min_lr_ratio']}x, gradient clipping "
        f"{schedule['grad_clip']}, seed {schedule['seed']}; steps per thread count "
        f"{_thread_counts(log['steps_at_thread_count'])}; torch {log['torch_version']}.",
        "",
        "![loss curve](loss_curve.png)",
        "",
    ]


def _evaluation_lines(log: dict) -> list[str]:
    held_out = log["held_out"]
    acceptance = log["acceptance"]
    depth_rates = ", ".join(f"{rate:.2f}" for rate in acceptance["acceptance_by_depth"])
    return [
        "## Held-out evaluation",
        "",
        "| measurement | value |",
        "| --- | --- |",
        f"| top-1 agreement with the target's greedy token (teacher-forced) | "
        f"{held_out['top1_agreement']:.3f} |",
        f"| first-draft acceptance at temperature 1, sum_x min(p, q) (teacher-forced) | "
        f"{held_out['sampled_acceptance']:.3f} |",
        f"| loss (SmoothL1 / CE) | {held_out['regression']:.4f} / "
        f"{held_out['cross_entropy']:.3f} |",
        f"| greedy tokens per target pass, k = {acceptance['draft_len']} | "
        f"{acceptance['tokens_per_pass']:.2f} |",
        f"| acceptance rate at draft depth 1..{acceptance['draft_len']} | {depth_rates} |",
        "",
        f"Agreement: {held_out['positions']:,} positions in held-out windows of "
        f"{held_out['seq_len']} tokens; the head reads the target's real features f_0..f_t and "
        "the tokens up to x_{t+1}, and its token for position t + 2 is compared with the "
        "target's argmax there.",
        "",
        f"Tokens per pass: {acceptance['prompts']} held-out prompts of "
        f"{acceptance['prompt_len']} tokens, each continued greedily by the target for "
        f"{acceptance['continuation_len']} tokens; `EagleProposer` then drafts "
        f"{acceptance['draft_len']} tokens per pass along that continuation (its own paged KV, "
        "its own predicted features after the first draft), the longest matching prefix is "
        "accepted plus the target's next token, as greedy verification does "
        f"({acceptance['passes']} passes). 1.00 would mean no draft is ever accepted. The "
        "target's greedy continuations repeat themselves a lot (see its card), which makes "
        "them easy to draft: expect less on sampled or more varied text.",
        "",
    ]


def _footer_lines(log: dict, weights_bytes: int) -> list[str]:
    target = log["target"]
    return [
        f"Weights: {weights_bytes / 1e6:.1f} MB (fp32 safetensors).",
        "",
        "## Reproduce",
        "",
        "```bash",
        f"python -m tokenmill.train eagle --target models/{target['name']} "
        f"--out models/{target['name']}/eagle"
        + (f" --max-minutes {log['max_seconds'] / 60:g}" if log.get("max_seconds") else ""),
        "```",
        "",
    ]
