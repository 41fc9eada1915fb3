"""Command line for training tokenmill's default models.

python -m tokenmill.train tokenizer --out models/pycoder
python -m tokenmill.train model --preset pycoder --tokenizer models/pycoder --out models/pycoder
python -m tokenmill.train card --model models/pycoder
python -m tokenmill.train eagle --target models/pycoder --out models/pycoder/eagle
python -m tokenmill.train tokenizer --kind reasoning --out models/pyreason
python -m tokenmill.train sft --model models/pyreason --out /tmp/lp --length-penalty 0.05
python -m tokenmill.train longctx --init-from models/pycoder --out models/pycoder-long
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenmill.train.presets import PRESETS


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill train",
        description="Train tokenmill's default models on the Python stdlib.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    tokenizer = commands.add_parser("tokenizer", help="train the byte-level BPE tokenizer")
    tokenizer.add_argument("--out", type=Path, required=True, help="directory to write it to")
    tokenizer.add_argument("--vocab-size", type=int, default=8192)
    tokenizer.add_argument("--corpus-root", type=Path, default=None, help="default: the stdlib")
    tokenizer.add_argument("--kind", choices=("code", "reasoning"), default="code",
                           help="code: BPE on the stdlib; reasoning: the pyreason chat tokenizer")

    model = commands.add_parser("model", help="train a model from random initialisation")
    model.add_argument("--preset", choices=sorted(PRESETS), required=True)
    model.add_argument("--tokenizer", type=Path, required=True, help="tokenizer directory")
    model.add_argument("--out", type=Path, required=True, help="model directory to write")
    model.add_argument("--steps", type=int, default=None, help="steps of the main (short) phase")
    model.add_argument("--final-steps", type=int, default=None, help="steps of the 2048 phase")
    model.add_argument("--corpus-root", type=Path, default=None, help="default: the stdlib")
    model.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="wall-clock cap; the main phase stops early if the machine is slower than planned",
    )
    model.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="continue from this trained model directory (a new stage in its log)",
    )
    model.add_argument("--peak-lr", type=float, default=None, help="override the preset's")
    model.add_argument("--warmup-steps", type=int, default=None, help="override the preset's")
    model.add_argument("--seed", type=int, default=None, help="override the preset's (0)")
    model.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    card = commands.add_parser("card", help="measure a trained model and write its README.md")
    card.add_argument("--model", type=Path, required=True, help="trained model directory")
    card.add_argument("--corpus-root", type=Path, default=None, help="default: the stdlib")
    card.add_argument("--rescore-per-kind", type=_count, default=0,
                      help="long-context models: score this many held-out task items per "
                           "kind and length again (the current scorer) before writing")

    sft = commands.add_parser(
        "sft", help="fine-tune a reasoning model with a length penalty on its thinking")
    sft.add_argument("--model", type=Path, required=True, help="trained reasoning model")
    sft.add_argument("--out", type=Path, required=True, help="model directory to write")
    sft.add_argument("--length-penalty", type=float, default=0.0,
                     help="alpha per thinking token (0: plain SFT, the control)")
    sft.add_argument("--steps", type=int, default=400)
    sft.add_argument("--max-minutes", type=float, default=None)
    sft.add_argument("--eval-per-level", type=int, default=50,
                     help="held-out items per level scored after fine-tuning (0: none)")

    longctx = commands.add_parser(
        "longctx", help="extend a code model to long context (larger RoPE base, long tasks)")
    longctx.add_argument("--init-from", type=Path, required=True, help="trained model directory")
    longctx.add_argument("--out", type=Path, required=True, help="model directory to write")
    longctx.add_argument("--max-minutes", type=float, default=None,
                         help="wall-clock cap; each phase stops at its share of it")
    longctx.add_argument("--steps-scale", type=float, default=1.0,
                         help="multiply every phase's step count (e.g. 0.01 for a smoke run)")
    longctx.add_argument("--phases", default=None,
                         help="override the recipe's phases: STEPS:SEQ_LEN:BATCH:TIME_SHARE,...")
    longctx.add_argument("--peak-lr", type=float, default=None, help="override the recipe's")
    longctx.add_argument("--seed", type=int, default=None, help="override the recipe's (0)")
    longctx.add_argument("--extra-questions", type=_count, default=None,
                         help="after a multi-key item's answer, ask up to N of its other "
                              "keys too (several lookups per context; recipe: 0)")
    longctx.add_argument("--kind-weights", type=kind_weights, default=None,
                         help="task kinds' shares of task rows, KIND:WEIGHT,... "
                              "(unnamed kinds keep 1), e.g. multi-key:3")
    longctx.add_argument("--eval-per-kind", type=int, default=20,
                         help="held-out task items per kind and length scored after training")
    longctx.add_argument("--corpus-root", type=Path, default=None, help="default: the stdlib")

    eagle = commands.add_parser("eagle", help="train an EAGLE-1 draft head for a trained model")
    eagle.add_argument("--target", type=Path, required=True, help="trained model directory")
    eagle.add_argument("--out", type=Path, required=True, help="head directory to write")
    eagle.add_argument("--steps", type=int, default=None, help="override the recipe's steps")
    eagle.add_argument("--max-minutes", type=float, default=None,
                       help="wall-clock cap on the training loop (measurements come after)")
    eagle.add_argument("--seed", type=int, default=None, help="override the recipe's (0)")
    eagle.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from this saved head (e.g. the head of the target before retraining)",
    )
    eagle.add_argument("--corpus-root", type=Path, default=None, help="default: the stdlib")
    eagle.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def _run_tokenizer(args: argparse.Namespace) -> int:
    from tokenmill.train.corpus import training_texts
    from tokenmill.train.reasoning_data import build_reasoning_tokenizer
    from tokenmill.train.tokenizer import save_tokenizer, train_bpe

    if args.kind == "reasoning":
        tokenizer = build_reasoning_tokenizer(args.out)
    else:
        tokenizer = train_bpe(training_texts(args.corpus_root), vocab_size=args.vocab_size)
        save_tokenizer(tokenizer, args.out)
    print(f"wrote tokenizer with {tokenizer.get_vocab_size()} tokens to {args.out}")
    return 0


def _corpus(preset, corpus_root: Path | None) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): generated items for a reasoning preset, else
    the stdlib's files split by path."""
    from tokenmill.train.corpus import read_sources, split_sources
    from tokenmill.train.reasoning_data import reasoning_corpus

    if preset.extra.get("data") == "reasoning":
        return reasoning_corpus(preset.extra, preset.schedule.seed)
    train, held_out = split_sources(read_sources(corpus_root))
    return [source.text for source in train], [source.text for source in held_out]


def _run_model(args: argparse.Namespace) -> int:
    from tokenmill.train.presets import get_preset
    from tokenmill.train.tokenizer import load_tokenizer
    from tokenmill.train.trainer import train_model

    vocab_size = len(load_tokenizer(args.tokenizer))
    preset = get_preset(args.preset, vocab_size).with_steps(args.steps, args.final_steps)
    preset = preset.with_schedule(
        peak_lr=args.peak_lr, warmup_steps=args.warmup_steps, seed=args.seed
    )
    train, held_out = _corpus(preset, args.corpus_root)
    log = train_model(
        preset,
        args.tokenizer,
        args.out,
        train,
        held_out,
        show_progress=not args.no_progress,
        max_seconds=None if args.max_minutes is None else args.max_minutes * 60,
        init_from=args.init_from,
    )
    summary = {
        key: log[key] for key in ("num_parameters", "tokens_seen", "train_seconds", "held_out")
    }
    print(json.dumps(summary, indent=1))
    return 0


def _run_card(args: argparse.Namespace) -> int:
    from tokenmill.train.card import write_model_card
    from tokenmill.train.presets import get_preset
    from tokenmill.train.reasoning_card import write_reasoning_card

    if (args.model / "longctx_log.json").is_file():
        from tokenmill.train.longctx_card import write_longctx_card

        if args.rescore_per_kind:
            path = args.model / "longctx_log.json"
            log = json.loads(path.read_text())
            log["task_accuracy"] = _score_longctx(args.model, args.corpus_root,
                                                  args.rescore_per_kind)
            path.write_text(json.dumps(log, indent=1) + "\n")
            print(json.dumps(log["task_accuracy"], indent=1))
        print(f"wrote {write_longctx_card(args.model)}")
        return 0
    preset = json.loads((args.model / "train_log.json").read_text())["preset"]
    if preset in PRESETS and get_preset(preset).extra.get("data") == "reasoning":
        path = write_reasoning_card(args.model)
    else:
        path = write_model_card(args.model, args.corpus_root)
    print(f"wrote {path}")
    return 0


def _run_sft(args: argparse.Namespace) -> int:
    from tokenmill.llm import LLM
    from tokenmill.train.reasoning_eval import eval_items, greedy_params, score, summarize
    from tokenmill.train.sft import finetune

    log = finetune(args.model, args.out, args.length_penalty, args.steps,
                   None if args.max_minutes is None else args.max_minutes * 60)
    if args.eval_per_level:
        llm = LLM(str(args.out), progress=False, num_threads=2, max_num_seqs=256)
        results = score(llm, eval_items(args.eval_per_level), greedy_params())
        log["eval"] = [row.as_dict() for row in summarize(results)]
    (args.out / "sft_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(json.dumps({k: v for k, v in log.items() if k != "loss"}, indent=1))
    return 0


def kind_weights(text: str) -> tuple[float, ...]:
    """`--kind-weights` (KIND:WEIGHT,...) as weights in KINDS order (checked as the
    recipe checks them)."""
    from tokenmill.train.longctx import check_kind_weights
    from tokenmill.train.longctx_tasks import KINDS

    weights = dict.fromkeys(KINDS, 1.0)
    for part in text.split(","):
        kind, _, weight = part.partition(":")
        if kind not in weights:
            raise argparse.ArgumentTypeError(
                f"unknown kind {kind!r} (kinds: {', '.join(KINDS)})")
        try:
            weights[kind] = float(weight)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not KIND:WEIGHT") from None
    try:
        check_kind_weights(tuple(weights.values()))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return tuple(weights.values())


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _run_longctx(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tokenmill.train.corpus import read_sources, split_sources
    from tokenmill.train.longctx import LongContextRecipe, LongPhase, train_long_context

    recipe = LongContextRecipe()
    if args.phases:
        fields = [part.split(":") for part in args.phases.split(",")]
        recipe = replace(recipe, phases=tuple(
            LongPhase(int(steps), int(seq), int(batch), float(share))
            for steps, seq, batch, share in fields))
    phases = tuple(replace(p, steps=max(1, round(p.steps * args.steps_scale)))
                   for p in recipe.phases)
    recipe = replace(recipe, phases=phases,
                     peak_lr=args.peak_lr if args.peak_lr is not None else recipe.peak_lr,
                     seed=args.seed if args.seed is not None else recipe.seed)
    if args.extra_questions is not None:
        recipe = replace(recipe, extra_questions=args.extra_questions)
    if args.kind_weights:
        recipe = replace(recipe, kind_weights=args.kind_weights)
    train, held_out = split_sources(read_sources(args.corpus_root))
    held_out_texts = [source.text for source in held_out]
    log = train_long_context(args.init_from, args.out, [source.text for source in train],
                             held_out_texts, recipe,
                             None if args.max_minutes is None else args.max_minutes * 60)
    if args.eval_per_kind:
        log["task_accuracy"] = _score_longctx(args.out, args.corpus_root, args.eval_per_kind)
        (args.out / "longctx_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(json.dumps({k: v for k, v in log.items() if k != "history"}, indent=1))
    return 0


def _score_longctx(model: Path, corpus_root: Path | None, per_kind: int) -> dict:
    """The model's dense greedy accuracy on `per_kind` held-out task items per kind at
    2048, 4096 and 8192 tokens (those its context holds)."""
    from tokenmill.llm import LLM
    from tokenmill.train.corpus import read_sources, split_sources
    from tokenmill.train.longctx import task_accuracy

    config = json.loads((model / "config.json").read_text())
    lengths = tuple(n for n in (2048, 4096, 8192) if n <= config["max_position_embeddings"])
    held_out = [source.text for source in split_sources(read_sources(corpus_root))[1]]
    llm = LLM(str(model), progress=False)
    try:
        return task_accuracy(llm, held_out, lengths, per_kind)
    finally:
        llm.engine.shutdown()


def _run_eagle(args: argparse.Namespace) -> int:
    from tokenmill.train.corpus import read_sources, split_sources
    from tokenmill.train.eagle import PYCODER_RECIPE, train_eagle_head

    recipe = PYCODER_RECIPE.with_overrides(steps=args.steps, seed=args.seed)
    train, held_out = split_sources(read_sources(args.corpus_root))
    log = train_eagle_head(
        args.target,
        args.out,
        [source.text for source in train],
        [source.text for source in held_out],
        recipe,
        show_progress=not args.no_progress,
        max_seconds=None if args.max_minutes is None else args.max_minutes * 60,
        init_from=args.init_from,
    )
    summary = {key: log[key] for key in ("steps", "tokens_seen", "train_seconds", "held_out",
                                         "acceptance")}
    print(json.dumps(summary, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; ``argv`` excludes the program name (``None`` reads ``sys.argv``)."""
    args = _build_parser().parse_args(argv)
    runners = {
        "tokenizer": _run_tokenizer,
        "model": _run_model,
        "card": _run_card,
        "sft": _run_sft,
        "eagle": _run_eagle,
        "longctx": _run_longctx,
    }
    return runners[args.command](args)
