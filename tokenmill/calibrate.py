"""`tokenmill calibrate sparse --model DIR`: the offline calibration of the
retrieval-topp attention backend, written to DIR/sparse_calibration.json.

It runs the model densely (transformers, eager attention, float32) on seeded probe
sequences and records each head's attention from chosen query positions to chosen key
positions, and the pre-RoPE query and key norms per rotary pair. Two probe texts
(`--text`):

    needle  long-context task items (train/longctx_tasks.py: needle and multi-key,
            filler from the training split of the stdlib corpus) with their answer
            appended; queries are the position that predicts the answer and the
            answer's own, keys the tokens of the line that holds the fact asked for.
            A head scores what it looks at while it answers a lookup (the
            retrieval-head score of DuoAttention / RetrievalAttention, as mass).
    random  [lead][X][filler][X] of random token ids; queries are the second copy of
            X, keys the first (an induction / copy score that needs no corpus).

What is scored and how is attention/sparse_calibration.py's docstring. Deterministic
for a seed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.attention.sparse_calibration import (
    FILENAME,
    SparseCalibration,
    attention_mass,
    pair_strength,
    strongest_pairs,
)

LEAD_TOKENS = 16  # before the first copy, so that attention sinks do not count as copying
PROBE_TEXTS = ("needle", "random")


@dataclass(frozen=True)
class Probe:
    ids: list[int]
    queries: list[int]  # positions whose attention is scored
    keys: list[int]  # positions it is scored on


def calibration_sequences(vocab_size: int, special: set[int], count: int, length: int,
                          copy_tokens: int, seed: int) -> list[list[int]]:
    """`count` sequences [lead][X][filler][X] of `length` ids, X `copy_tokens` ids long
    and starting at LEAD_TOKENS."""
    if length < 2 * copy_tokens + LEAD_TOKENS + 16:
        raise ValueError(f"length: at least 2 x copy_tokens + {LEAD_TOKENS + 16} = "
                         f"{2 * copy_tokens + LEAD_TOKENS + 16}, got {length}")
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([i for i in range(vocab_size) if i not in special])
    sequences = []
    for _ in range(count):
        ids = allowed[torch.randint(len(allowed), (length - copy_tokens,), generator=generator)]
        copy = ids[LEAD_TOKENS:LEAD_TOKENS + copy_tokens]
        sequences.append(ids.tolist() + copy.tolist())
    return sequences


def copy_probes(vocab_size: int, special: set[int], count: int, length: int,
                copy_tokens: int, seed: int) -> list[Probe]:
    """Random-token probes: the second copy of X (its first token aside) on the first."""
    first = list(range(LEAD_TOKENS, LEAD_TOKENS + copy_tokens))
    second = list(range(length - copy_tokens + 1, length))
    return [Probe(ids, second, first) for ids in
            calibration_sequences(vocab_size, special, count, length, copy_tokens, seed)]


def needle_probes(tokenizer, texts: list[str], count: int, length: int, seed: int
                  ) -> list[Probe]:
    """Task probes: needle and multi-key items of about `length` tokens with the answer
    appended; the answering positions on the tokens of the fact line asked for."""
    from tokenmill.train.longctx_tasks import make_item

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    rng = random.Random(seed)
    probes = []
    for index in range(count):
        kind = ("needle", "multi-key")[index % 2]
        item = make_item(kind, rng.randrange(1 << 30), texts, length - 16, count_tokens,
                         distractors=rng.randint(4, 16))
        name = item.prompt.rsplit("assert KEY_", 1)[1].removesuffix(" ==")
        fact = f"KEY_{name} = {item.answer}"
        start = item.prompt.index(fact + "\n")  # names are distinct: one such line
        text = item.prompt + " " + item.answer
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = encoded["offset_mapping"]
        keys = [i for i, (a, b) in enumerate(spans) if a < start + len(fact) and b > start]
        answer_from = len(item.prompt)
        answering = [i for i, (a, b) in enumerate(spans) if b > answer_from]
        queries = [answering[0] - 1] + answering[:-1]  # each predicts the next answer token
        probes.append(Probe(list(encoded["input_ids"]), queries, keys))
    return probes


def calibrate_sparse(model_dir: Path, seed: int = 0, sequences: int = 4, length: int = 2048,
                     copy_tokens: int = 64, index_dims: int = 16, text: str = "needle",
                     texts: list[str] | None = None) -> SparseCalibration:
    """`texts`: the filler of `needle` probes (default: the training split of the stdlib
    corpus)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if text not in PROBE_TEXTS:
        raise ValueError(f"text: one of {PROBE_TEXTS}, got {text!r}")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = model.model.layers
    length = min(length, config.max_position_embeddings)
    if text == "random":
        special = {i for i in (config.bos_token_id, config.eos_token_id, config.pad_token_id)
                   if isinstance(i, int)}
        probes = copy_probes(config.vocab_size, special, sequences, length, copy_tokens, seed)
        described = f"random token ids [{LEAD_TOKENS}][X][filler][X]"
    else:
        if texts is None:
            from itertools import islice

            from tokenmill.train.corpus import training_texts
            texts = list(islice(training_texts(), 400))
        probes = needle_probes(AutoTokenizer.from_pretrained(str(model_dir)), texts,
                               sequences, length, seed)
        described = "needle and multi-key task items, answer appended"
    scores = torch.zeros(len(layers), heads)
    strength = torch.zeros(len(layers), kv_heads, head_dim // 2)
    captured: dict[tuple[int, str], torch.Tensor] = {}
    current: list[Probe] = []

    def keep(layer: int, name: str, width: int):
        def hook(module, inputs, output):
            captured[(layer, name)] = output.detach().reshape(-1, width, head_dim)
        return hook

    def attention_hook(layer: int):
        def hook(module, inputs, output):
            weights = output[1]  # [1, H, L, L], eager attention's probabilities
            probe = current[-1]
            scores[layer] += attention_mass(weights[0].float(), probe.queries, probe.keys)
        return hook

    handles = []
    for index, layer in enumerate(layers):
        attention = layer.self_attn
        q_module = getattr(attention, "q_norm", None) or attention.q_proj
        k_module = getattr(attention, "k_norm", None) or attention.k_proj
        handles += [q_module.register_forward_hook(keep(index, "q", heads)),
                    k_module.register_forward_hook(keep(index, "k", kv_heads)),
                    attention.register_forward_hook(attention_hook(index))]
    try:
        with torch.no_grad():
            for probe in probes:
                current.append(probe)
                model(input_ids=torch.tensor([probe.ids]))
                for index in range(len(layers)):
                    strength[index] += pair_strength(captured[(index, "q")],
                                                     captured[(index, "k")], kv_heads)
    finally:
        for handle in handles:
            handle.remove()
    scores /= len(probes)
    per_kv = scores.view(len(layers), kv_heads, heads // kv_heads).amax(-1)
    return SparseCalibration(
        num_layers=len(layers), num_kv_heads=kv_heads, head_dim=head_dim,
        index_dims=index_dims,
        retrieval_score=[[round(float(s), 6) for s in row] for row in per_kv],
        index_pairs=[strongest_pairs(row, index_dims) for row in strength],
        method={"score": f"{text} attention mass (max over each KV head's query heads)",
                "index": "rotary pairs by mean |q_pair| x |k_pair|, pre-RoPE",
                "text": described, "seed": seed, "sequences": sequences,
                "length": length,
                **({"copy_tokens": copy_tokens} if text == "random" else {})})


def add_calibrate_subcommand(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser("calibrate", help="offline calibration a backend needs (sparse: "
                         "retrieval heads and index dimensions for retrieval-topp)")
    cmd.add_argument("what", choices=("sparse",))
    cmd.add_argument("--model", required=True, help="Hugging Face model directory")
    cmd.add_argument("--output", default=None, help=f"default: MODEL/{FILENAME}")
    cmd.add_argument("--seed", type=int, default=0)
    cmd.add_argument("--sequences", type=int, default=4)
    cmd.add_argument("--length", type=int, default=2048,
                     help="tokens per sequence (capped at the model's context)")
    cmd.add_argument("--text", choices=PROBE_TEXTS, default="needle",
                     help="probe sequences: task items (needle) or random-token copies")
    cmd.add_argument("--copy-tokens", type=int, default=64, help="length of X (--text random)")
    cmd.add_argument("--index-dims", type=int, default=16,
                     help="key dimensions of a retrieval head's index (whole rotary pairs)")
    cmd.add_argument("--log-level", default="info")
    cmd.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    model = Path(args.model)
    if not (model / "config.json").is_file():
        print(f"error: model: {args.model!r} is not a Hugging Face model directory",
              file=sys.stderr)
        return 2
    if args.sequences < 1 or not 2 <= args.index_dims <= 256 or args.copy_tokens < 2:
        print("error: --sequences >= 1, --index-dims in [2, 256] and --copy-tokens >= 2",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        calibration = calibrate_sparse(model, args.seed, args.sequences, args.length,
                                       args.copy_tokens, args.index_dims, args.text)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    output = Path(args.output) if args.output else model / FILENAME
    calibration.save(output)
    print(f"retrieval score per KV head ({calibration.method['score']}):")
    for layer, row in enumerate(calibration.retrieval_score):
        print(f"  layer {layer}: " + "  ".join(f"{s:.3f}" for s in row))
    chosen = calibration.retrieval_heads(2, 0.15)
    picked = [(layer, head) for layer, heads in enumerate(chosen) for head in heads]
    print(f"retrieval heads at the defaults (dense layers 2, fraction 0.15): {picked}")
    print(f"wrote {output} ({time.perf_counter() - started:.1f} s)")
    return 0
