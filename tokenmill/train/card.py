"""Model cards: measure a trained model directory and write its README.md.

The card's numbers come from the directory itself: ``train_log.json`` written by
the trainer, plus greedy samples and (for MoE models) the expert load measured
here by loading the saved files with ``transformers`` exactly as a user would.
The measurements are also stored under ``"card"`` in ``train_log.json``.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill.train.corpus import HELD_OUT_BUCKETS, held_out_texts
from tokenmill.train.evaluation import expert_load, greedy_samples, imbalance_factor
from tokenmill.train.packing import evaluation_windows, pack_documents
from tokenmill.train.trainlog import stages_of

EXPERT_LOAD_SEQ_LEN = 512


def measure(model_dir: Path, corpus_root: Path | None) -> dict:
    """Greedy samples and, for MoE models, the held-out expert load."""
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    result: dict = {"samples": greedy_samples(model, tokenizer)}
    if getattr(model.config, "num_local_experts", None):
        tokens = pack_documents(
            tokenizer.backend_tokenizer,
            held_out_texts(corpus_root),
            tokenizer.eos_token_id,
        )
        windows = evaluation_windows(tokens, EXPERT_LOAD_SEQ_LEN, None)
        fractions = expert_load(model, windows, batch_size=8)
        result["expert_load"] = {
            "seq_len": EXPERT_LOAD_SEQ_LEN,
            "tokens": int(windows.numel()),
            "top_k": model.config.num_experts_per_tok,
            "fractions": fractions,
            "imbalance": [imbalance_factor(layer) for layer in fractions],
        }
    return result


def write_model_card(model_dir: Path, corpus_root: Path | None = None) -> Path:
    """Measure ``model_dir`` and write ``model_dir/README.md``; returns its path."""
    log_path = model_dir / "train_log.json"
    log = json.loads(log_path.read_text())
    log["card"] = measure(model_dir, corpus_root)
    log_path.write_text(json.dumps(log, indent=1) + "\n")
    weights_bytes = (model_dir / "model.safetensors").stat().st_size
    card_path = model_dir / "README.md"
    config = json.loads((model_dir / "config.json").read_text())
    card_path.write_text(render_card(log, config, weights_bytes))
    return card_path


def architecture_rows(log: dict, config: dict) -> list[str]:
    rows = [
        ("class", log["model_class"]),
        ("hidden size", config["hidden_size"]),
        ("layers", config["num_hidden_layers"]),
        (
            "attention heads (query / key-value)",
            f"{config['num_attention_heads']} / {config['num_key_value_heads']}",
        ),
        ("head dim", config["head_dim"]),
        (
            "MLP intermediate size" + (" (per expert)" if "num_local_experts" in config else ""),
            config["intermediate_size"],
        ),
        ("vocabulary", config["vocab_size"]),
        ("max position embeddings", config["max_position_embeddings"]),
        ("RoPE theta", config["rope_parameters"]["rope_theta"]),
        ("tied input/output embeddings", config["tie_word_embeddings"]),
    ]
    if "num_local_experts" in config:
        rows.append(
            (
                "experts / active per token",
                f"{config['num_local_experts']} / {config['num_experts_per_tok']}",
            )
        )
        rows.append(("router aux loss coefficient", config["router_aux_loss_coef"]))
    return [f"| {name} | {value} |" for name, value in rows]


def _stage_lines(index: int, stage: dict, num_stages: int) -> list[str]:
    schedule = stage["schedule"]
    start = "random initialisation" if stage["init"] == "random" else "the previous stage's weights"
    lines = []
    if num_stages > 1:
        lines += [f"### Stage {index + 1} (from {start})", ""]
    lines += [
        "| phase | steps | sequence length | batch | tokens / step | wall time |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    phases = zip(schedule["phases"], stage["phase_steps"], stage["phase_seconds"], strict=True)
    for number, (phase, steps, seconds) in enumerate(phases, start=1):
        lines.append(
            f"| {number} | {steps} of {phase['steps']} planned | {phase['seq_len']} | "
            f"{phase['batch_size']} | {phase['seq_len'] * phase['batch_size']} | "
            f"{seconds / 60:.1f} min |"
        )
    lines += [
        "",
        f"AdamW (betas {schedule['beta1']}, {schedule['beta2']}, weight decay "
        f"{schedule['weight_decay']} on matrices), peak LR {schedule['peak_lr']} after "
        f"{schedule['warmup_steps']} warmup steps, cosine decay to "
        f"{schedule['min_lr_ratio']}x peak, gradient clipping {schedule['grad_clip']}, "
        f"seed {schedule['seed']}. {_thread_sentence(stage['steps_at_thread_count'])}",
    ]
    if stage.get("max_seconds"):
        lines += [
            "",
            f"Wall-clock budget {stage['max_seconds'] / 60:.0f} min: the short-context phase "
            "stops when 90% of it is spent (the cosine schedule follows the larger of step and "
            f"time progress), then the {schedule['phases'][-1]['seq_len']} phase runs in full.",
        ]
    return lines


def schedule_lines(log: dict) -> list[str]:
    stages = stages_of(log)
    lines = []
    for index, stage in enumerate(stages):
        lines += ([""] if index else []) + _stage_lines(index, stage, len(stages))
    return lines


def _thread_sentence(steps_at: dict[str, int]) -> str:
    counts = ", ".join(f"{steps} at {threads}" for threads, steps in steps_at.items())
    return (
        f"Steps per intra-op thread count ({counts}): the trainer keeps whichever count "
        "measured faster, since a starved second thread slows a 2-thread step down."
    )


def _expert_lines(expert: dict) -> list[str]:
    num_experts = len(expert["fractions"][0])
    header = "| layer | " + " | ".join(f"e{i}" for i in range(num_experts)) + " | max/mean |"
    lines = [
        f"Fraction of routed (token, slot) assignments per expert, top-{expert['top_k']} routing "
        f"recomputed from `output_router_logits=True`, over {expert['tokens']} held-out tokens "
        f"in windows of {expert['seq_len']}. A perfectly balanced layer has "
        f"{1 / num_experts:.3f} per expert and max/mean 1.00.",
        "",
        header,
        "| --- " * (num_experts + 2) + "|",
    ]
    for layer, (fractions, imbalance) in enumerate(
        zip(expert["fractions"], expert["imbalance"], strict=True)
    ):
        cells = " | ".join(f"{f:.3f}" for f in fractions)
        lines.append(f"| {layer} | {cells} | {imbalance:.2f} |")
    return lines


def _sample_lines(samples: list[dict[str, str]]) -> list[str]:
    lines = [
        "Greedy (`generate(do_sample=False)`, 64 new tokens), prompt then completion, "
        "not cherry-picked. The prompts end where a token ends in real code; a prompt "
        "that stops at a bare newline or inside indentation splits a token the model "
        "only ever saw whole (byte-level BPE merges a newline with the spaces after it) "
        "and derails it:",
        "",
    ]
    for sample in samples:
        # Four-backtick fences so a completion containing ``` cannot end the block.
        lines += ["````python", sample["prompt"] + sample["completion"], "````", ""]
    return lines


def _description_lines(log: dict, name: str) -> list[str]:
    """Front matter, what the model is, its data, licence and tokenizer."""
    python_version = platform.python_version()
    return [
        "---",
        "license: other",
        "license_name: psf-2.0",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "---",
        "",
        f"# {name}",
        "",
        f"A {log['num_parameters'] / 1e6:.2f}M-parameter {log['model_class']} trained from random "
        "initialisation by tokenmill on the Python standard library, on a 2-core CPU. It is a "
        "small completion model for testing and demonstrating the engine; it has no chat "
        "template and is not a useful code assistant.",
        "",
        "## Training data and licence",
        "",
        f"The `.py` files of the CPython {python_version} standard library (`Lib/`), excluding "
        "`site-packages`, build-configuration dumps and the regression-test suite (`test/`, "
        "`tests/`, `idle_test/`), in sorted path order, one `<|endoftext|>` after each file. "
        f"Files whose path's SHA-256 falls in bucket 0 of {HELD_OUT_BUCKETS} are held out for "
        f"evaluation: {log['train_tokens_in_corpus']:,} training tokens and "
        f"{log['held_out_tokens_in_corpus']:,} held-out tokens.",
        "",
        "The Python standard library is distributed under the Python Software Foundation "
        "License Version 2. These weights are trained on it and are distributed under the same "
        "PSF License terms (see https://docs.python.org/3/license.html).",
        "",
        "The tokenizer is a byte-level BPE with 8192 tokens trained on the same training files; "
        "`<|endoftext|>` (id 0) is BOS, EOS and padding. It adds no prefix space and "
        "round-trips any string exactly.",
        "",
    ]


def _measurement_lines(log: dict, config: dict, weights_bytes: int) -> list[str]:
    """Architecture, training run and held-out evaluation."""
    held_out = log["held_out"]
    return [
        "## Architecture",
        "",
        "| | |",
        "| --- | --- |",
        *architecture_rows(log, config),
        f"| parameters | {log['num_parameters']:,} |",
        f"| weights file | {weights_bytes / 1e6:.1f} MB (fp32 safetensors) |",
        "",
        "## Training",
        "",
        *schedule_lines(log),
        "",
        f"Tokens seen: {log['tokens_seen']:,} ({log['epochs']:.2f} epochs) in {log['steps']} "
        f"steps; wall time {log['train_seconds'] / 60:.1f} min "
        f"({log['tokens_per_second']:.0f} tokens/s) on a 2-core CPU shared with other work, "
        f"at low priority, torch {log['torch_version']}, Python {sys.version.split()[0]}.",
        "",
        "![loss curve](loss_curve.png)",
        "",
        "## Held-out evaluation",
        "",
        "| context | held-out tokens scored | loss (nats/token) | perplexity |",
        "| --- | --- | --- | --- |",
        *[
            f"| {seq_len} | {r['tokens']:,} | {r['loss']:.3f} | {r['perplexity']:.2f} |"
            for seq_len, r in held_out.items()
        ],
        "",
        "Non-overlapping windows over the held-out files; every predicted token counts once.",
        "",
    ]


def render_card(log: dict, config: dict, weights_bytes: int) -> str:
    """The README.md text for one model; ``config`` is its saved config.json."""
    name = log["preset"]
    parts = _description_lines(log, name) + _measurement_lines(log, config, weights_bytes)
    expert = log["card"].get("expert_load")
    if expert is not None:
        parts += ["## Expert load", "", *_expert_lines(expert), ""]
    parts += ["## Sample completions", "", *_sample_lines(log["card"]["samples"])]
    parts += [
        "## Reproduce",
        "",
        "See `docs/TRAINING.md` in the tokenmill repository:",
        "",
        "```bash",
        "python -m tokenmill.train tokenizer --out models/pycoder",
        f"python -m tokenmill.train model --preset {name} --tokenizer models/pycoder "
        f"--out models/{name}",
        f"python -m tokenmill.train card --model models/{name}",
        "```",
        "",
    ]
    return "\n".join(parts)
