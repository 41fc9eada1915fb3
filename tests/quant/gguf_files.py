"""GGUF files written with the `gguf` package from the tiny transformers checkpoints, as
llama.cpp's converter writes them: its tensor names (the package's own name map), Q and
K rows permuted for the "llama" architecture, stacked expert tensors, a BPE tokenizer
in the metadata. Each tensor's format is chosen by a callback; beside the file, a
safetensors directory with what the file's tensors dequantize to (the gguf package's
own dequantization) is the reference a loaded file must equal."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

ARCHES = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA,
          "mixtral": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
          "qwen3": gguf.MODEL_ARCH.QWEN3}
EXPERT_PARTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotary halves interleaved."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def encode(array: np.ndarray, format: str) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, what the gguf package dequantizes it to)."""
    if format == "F32":
        return array, array
    if format == "F16":
        return array.astype(np.float16), array.astype(np.float16).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[format]
    stored = gguf.quants.quantize(array, qtype)
    return stored, gguf.quants.dequantize(stored, qtype).astype(np.float32)


def write_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, config: dict) -> None:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m
                             for m in spec["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])


def write_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if config.get("num_local_experts"):
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])


def checkpoint_tensors(model_dir: Path, config: dict) -> dict[str, np.ndarray]:
    """Hugging Face tensors, experts stacked per layer and projection, Q/K permuted."""
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name).float().numpy() for name in f.keys()}
    stacked: dict[str, np.ndarray] = {}
    for name in sorted(tensors):
        if ".experts." in name:
            owner, expert, part, _ = name.rsplit(".", 3)
            key = f"{owner}.{EXPERT_PARTS[part]}"
            stacked[key] = np.stack([tensors[f"{owner}.{e}.{part}.weight"] for e in
                                     range(config["num_local_experts"])])
            continue
        array = tensors[name]
        if config["model_type"] in ("llama", "mistral", "mixtral"):
            if ".q_proj." in name:
                array = permute(array, config["num_attention_heads"])
            if ".k_proj." in name:
                array = permute(array, config["num_key_value_heads"])
        stacked[name] = array
    if config.get("tie_word_embeddings"):
        stacked.pop("lm_head.weight", None)
    return stacked


def gguf_name(name: str, names: gguf.TensorNameMap) -> str:
    if "_exps" in name:
        owner, part = name.rsplit(".", 1)
        return f"blk.{owner.split('.')[2]}.{part}.weight"
    stem, kind = name.rsplit(".", 1)
    return f"{names.get_name(stem)}.{kind}"


def write_gguf(model_dir: Path, out_dir: Path, format_of: Callable[[str, np.ndarray], str]
               ) -> tuple[Path, Path]:
    """(the GGUF file, the reference directory of its dequantized tensors)."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = ARCHES[config["model_type"]]
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    path = out_dir / "model.gguf"
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    write_metadata(writer, config)
    write_tokenizer(writer, model_dir, config)
    reference: dict[str, torch.Tensor] = {}
    for name, array in checkpoint_tensors(model_dir, config).items():
        target = gguf_name(name, names)
        format = format_of(target, array) if array.ndim > 1 else "F32"
        stored, values = encode(np.ascontiguousarray(array), format)
        raw = None if format in ("F32", "F16") else gguf.GGMLQuantizationType[format]
        writer.add_tensor(target, stored, raw_dtype=raw)
        reference[name] = torch.from_numpy(np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, write_reference(model_dir, out_dir / "reference", config, reference)


def write_reference(model_dir: Path, out: Path, config: dict,
                    tensors: dict[str, torch.Tensor]) -> Path:
    """A safetensors checkpoint holding the file's dequantized tensors (Q/K un-permuted,
    experts one tensor each)."""
    out.mkdir()
    flat = {}
    for name, tensor in tensors.items():
        if "_exps" in name:
            owner, part = name.rsplit(".", 1)
            hf_part = {v: k for k, v in EXPERT_PARTS.items()}[part]
            for expert, weight in enumerate(tensor):
                flat[f"{owner}.{expert}.{hf_part}.weight"] = weight.contiguous()
            continue
        if config["model_type"] in ("llama", "mistral", "mixtral") and (
                ".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads" if ".q_proj." in name
                           else "num_key_value_heads"]
            order = np.argsort(permute(np.arange(tensor.shape[0]), heads))
            tensor = tensor[torch.from_numpy(order)]
        flat[name] = tensor.contiguous()
    save_file(flat, str(out / "model.safetensors"))
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out
