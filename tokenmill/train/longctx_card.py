"""The README.md (model card) and loss plot of a model extended to long context by
`python -m tokenmill.train longctx`, rendered from its longctx_log.json."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

from tokenmill.train.corpus import HELD_OUT_BUCKETS
from tokenmill.train.curve import moving_average
from tokenmill.train.longctx_tasks import KINDS


def write_longctx_card(model_dir: Path) -> Path:
    log = json.loads((model_dir / "longctx_log.json").read_text())
    config = json.loads((model_dir / "config.json").read_text())
    weights = (model_dir / "model.safetensors").stat().st_size
    plot_history(log["history"], model_dir / "loss_curve.png")
    path = model_dir / "README.md"
    path.write_text(render_longctx_card(model_dir.name, log, config, weights))
    return path


def plot_history(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    figure, axis = plt.subplots(figsize=(7, 3.6))
    axis.plot(steps, moving_average([h["loss"] for h in history], 25), label="loss")
    answers = [(h["step"], h["answer_ce"]) for h in history if not math.isnan(h["answer_ce"])]
    axis.plot([s for s, _ in answers], moving_average([a for _, a in answers], 25),
              label="answer-token cross-entropy")
    for index in range(1, len(history)):
        if history[index]["seq_len"] != history[index - 1]["seq_len"]:
            axis.axvline(history[index]["step"], color="grey", lw=0.6, ls=":")
    axis.set_xlabel("step (dotted: a longer sequence length starts)")
    axis.set_ylabel("nats (moving average of 25)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _stage_lines(number: int, stage: dict) -> list[str]:
    recipe, budget = stage["recipe"], stage.get("max_seconds")
    lines = [
        f"Stage {number}: "
        + (f"wall-clock budget {budget / 60:.0f} min, each phase stopping at its share."
           if budget else "no wall-clock budget."),
        "",
        "| phase | steps done / planned | sequence length | batch | wall time |",
        "| --- | --- | --- | --- | --- |",
    ]
    for index, phase in enumerate(recipe["phases"]):
        lines.append(f"| {index + 1} | {stage['phase_steps'][index]} / {phase['steps']} | "
                     f"{phase['seq_len']} | {phase['batch_size']} | "
                     f"{stage['phase_seconds'][index] / 60:.1f} min |")
    lines += [
        "",
        f"AdamW (0.9, 0.95; weight decay {recipe['weight_decay']} on matrices), peak LR "
        f"{recipe['peak_lr']} after {recipe['warmup_steps']} warmup steps, cosine to "
        f"{recipe['min_lr_ratio']}x (following the larger of step and time progress), "
        f"gradient clipping {recipe['grad_clip']}, seed {recipe['seed']}, task rows "
        f"{recipe['task_share']} of all. Loss: mean cross-entropy over every token plus "
        f"{recipe['answer_weight']} x the mean over the answer tokens." + _task_mix(recipe),
        "",
    ]
    return lines


def _task_mix(recipe: dict) -> str:
    """The stage's task knobs where they differ from the defaults (a log written before
    they existed has neither)."""
    said = ""
    weights = recipe.get("kind_weights")
    if weights and len(set(weights)) > 1:
        said += " Task kinds drawn in proportion " + ", ".join(
            f"{kind} {weight:g}" for kind, weight in zip(KINDS, weights, strict=True)) + "."
    if recipe.get("extra_questions"):
        said += (f" After a multi-key item's answer, up to {recipe['extra_questions']} of its"
                 " other planted keys asked too (each value an answer).")
    return said


def render_longctx_card(name: str, log: dict, config: dict, weights: int) -> str:
    recipe = log["stages"][0]["recipe"]
    base = Path(log["init_from"]).name
    lines = [
        "---", "license: other", "license_name: psf-2.0", "library_name: transformers",
        "pipeline_tag: text-generation", "---", "",
        f"# {name}",
        "",
        f"`{base}` (tokenmill's embedded code model) extended from 2048 to "
        f"{config['max_position_embeddings']} tokens of context by tokenmill on a 2-core CPU, "
        "to measure sparse attention on (issue 18): same architecture and tokenizer, RoPE "
        f"base raised from 10000 to {recipe['rope_theta']:.0f}, and continued training on "
        "long-context retrieval tasks written as Python plus plain code. A test model, not "
        "a useful assistant.",
        "",
        "## Data and licence",
        "",
        "The training files of the CPython 3.11.7 standard library (the same split as "
        f"`{base}`: paths whose SHA-256 falls in bucket 0 of {HELD_OUT_BUCKETS} are held "
        "out), distributed under the PSF License Version 2, as are these weights. Rows: "
        f"with probability {recipe['task_share']} one task item "
        "(`tokenmill.train.longctx_tasks`: needle, multi-key, multi-value or code, of a "
        "random length up to the row's, seeds from 1,000,000 + 100,000 x the stage's seed "
        "(a stage run before that rule drew from 1,000,000), filler from training files), "
        "its answer, an end of text and a code window to fill the row; otherwise a plain "
        "code window.",
        "",
        "## Training",
        "",
    ]
    for number, stage in enumerate(log["stages"], start=1):
        lines += _stage_lines(number, stage)
    lines += [
        f"Total {sum(s['train_seconds'] for s in log['stages']) / 60:.1f} min, torch "
        f"{log['torch_version']}, {platform.machine()}.",
        "",
        "![loss curve](loss_curve.png)",
        "",
        "## Evaluation",
        "",
        "Held-out perplexity (8 windows spread over the held-out files):",
        "",
        "| context | before (base weights, new RoPE base) | after |",
        "| --- | --- | --- |",
    ]
    for length, after in log["held_out_after"].items():
        before = log["held_out_before"].get(length, {}).get("perplexity")
        lines.append(f"| {length} | {before:.2f} | {after['perplexity']:.2f} |"
                     if before else f"| {length} | | {after['perplexity']:.2f} |")
    accuracy = log.get("task_accuracy")
    if accuracy:
        lengths = list(next(iter(accuracy.values())))
        lines += [
            "",
            "Task accuracy, dense attention through tokenmill, greedy, held-out items (files "
            "never trained on, seeds 0 ..), the completion's first line must be the answer, "
            "with nothing after it but spaces or a comment:",
            "",
            "| task | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
            "|" + " --- |" * (len(lengths) + 1),
        ]
        for kind, by_length in accuracy.items():
            lines.append(f"| {kind} | " + " | ".join(f"{100 * v:.0f}%"
                                                     for v in by_length.values()) + " |")
    lines += [
        "",
        f"Weights: {weights / 1e6:.1f} MB (float32 safetensors). Reproduce: "
        f"`python -m tokenmill.train longctx --init-from models/{base} --out models/{name} "
        "...` with each stage's phases and budget above (a later stage continues from "
        f"models/{name}), then "
        f"`python -m tokenmill.train card --model models/{name}` and `tokenmill calibrate "
        f"sparse --model models/{name}`.",
        "",
    ]
    return "\n".join(lines)
