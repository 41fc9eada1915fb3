"""`tokenmill calibrate sparse --model DIR`: the offline calibration of the
retrieval-topp attention backend, written to DIR/sparse_calibration.json.

It runs the model densely (transformers, eager attention, float32) on seeded
sequences [lead][X][filler][X] of random token ids (the sequence an induction or retrieval
head copies from; random ids need no corpus and hold no answer a head could guess),
records each head's attention from the second copy of X back to the first, and the
pre-RoPE query and key norms per rotary pair. What is scored and how is
attention/sparse_calibration.py's docstring. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from tokenmill.attention.sparse_calibration import (
    FILENAME,
    SparseCalibration,
    copy_attention_mass,
    pair_strength,
    strongest_pairs,
)

LEAD_TOKENS = 16  # before the first copy, so that attention sinks do not count as copying


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


def calibrate_sparse(model_dir: Path, seed: int = 0, sequences: int = 4, length: int = 2048,
                     copy_tokens: int = 64, index_dims: int = 16) -> SparseCalibration:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = model.model.layers
    length = min(length, config.max_position_embeddings)
    special = {i for i in (config.bos_token_id, config.eos_token_id, config.pad_token_id)
               if isinstance(i, int)}
    scores = torch.zeros(len(layers), heads)
    strength = torch.zeros(len(layers), kv_heads, head_dim // 2)
    first = range(LEAD_TOKENS, LEAD_TOKENS + copy_tokens)
    second = range(length - copy_tokens, length)
    captured: dict[tuple[int, str], torch.Tensor] = {}

    def keep(layer: int, name: str, width: int):
        def hook(module, inputs, output):
            captured[(layer, name)] = output.detach().reshape(-1, width, head_dim)
        return hook

    def attention_hook(layer: int):
        def hook(module, inputs, output):
            weights = output[1]  # [1, H, L, L], eager attention's probabilities
            scores[layer] += copy_attention_mass(weights[0].float(), first, second)
        return hook

    handles = []
    for index, layer in enumerate(layers):
        attention = layer.self_attn
        q_module = getattr(attention, "q_norm", None) or attention.q_proj
        k_module = getattr(attention, "k_norm", None) or attention.k_proj
        handles += [q_module.register_forward_hook(keep(index, "q", heads)),
                    k_module.register_forward_hook(keep(index, "k", kv_heads)),
                    attention.register_forward_hook(attention_hook(index))]
    batch = calibration_sequences(config.vocab_size, special, sequences, length,
                                  copy_tokens, seed)
    try:
        with torch.no_grad():
            for ids in batch:
                model(input_ids=torch.tensor([ids]))
                for index in range(len(layers)):
                    strength[index] += pair_strength(captured[(index, "q")],
                                                     captured[(index, "k")], kv_heads)
    finally:
        for handle in handles:
            handle.remove()
    scores /= len(batch)
    per_kv = scores.view(len(layers), kv_heads, heads // kv_heads).amax(-1)
    return SparseCalibration(
        num_layers=len(layers), num_kv_heads=kv_heads, head_dim=head_dim,
        index_dims=index_dims,
        retrieval_score=[[round(float(s), 6) for s in row] for row in per_kv],
        index_pairs=[strongest_pairs(row, index_dims) for row in strength],
        method={"score": "needle-copy attention mass (max over each KV head's query heads)",
                "index": "rotary pairs by mean |q_pair| x |k_pair|, pre-RoPE",
                "text": f"random token ids [{LEAD_TOKENS}][X][filler][X]", "seed": seed,
                "sequences": sequences, "length": length, "copy_tokens": copy_tokens})


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
    cmd.add_argument("--copy-tokens", type=int, default=64, help="length of X")
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
                                       args.copy_tokens, args.index_dims)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    output = Path(args.output) if args.output else model / FILENAME
    calibration.save(output)
    print("retrieval score per KV head (attention mass from the second copy to the first):")
    for layer, row in enumerate(calibration.retrieval_score):
        print(f"  layer {layer}: " + "  ".join(f"{s:.3f}" for s in row))
    chosen = calibration.retrieval_heads(2, 0.15)
    picked = [(layer, head) for layer, heads in enumerate(chosen) for head in heads]
    print(f"retrieval heads at the defaults (dense layers 2, fraction 0.15): {picked}")
    print(f"wrote {output} ({time.perf_counter() - started:.1f} s)")
    return 0
