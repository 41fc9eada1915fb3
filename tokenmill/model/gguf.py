"""GGUF checkpoints (llama.cpp's one-file format), read with the `gguf` package.

The metadata becomes the Hugging Face config the models are built from, tensor names
are mapped back onto Hugging Face names (so the models' own loading, fusing and
splitting apply), and llama.cpp's reordering of Q and K rows for its rotary layout
(its converter permutes them for the "llama" architecture) is undone. Float tensors
(F32, F16, BF16) arrive as torch tensors; block-quantized Linear weights arrive as
`BlockTensor`s, which a quantized method keeps and any other dequantizes with the
`gguf` package; other block-quantized tensors (an untied embedding) are dequantized
here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.layers.block_tensor import BlockTensor

logger = logging.getLogger(__name__)

FLOAT_FORMATS = ("F32", "F16", "BF16")
# general.architecture -> (architectures[0], model_type); a mixture of experts in the
# "llama" architecture is Mixtral.
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                 "qwen3": ("Qwen3ForCausalLM", "qwen3")}
# Architectures whose Q and K rows llama.cpp's converter permutes.
PERMUTED_QK = ("llama",)
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "block_sparse_moe.gate",
}
# Stacked expert tensors [E, rows, columns] (or one per expert, "ffn_gate.3").
EXPERT_NAMES = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2",
                "ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)$")


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix == ".gguf"


def dequantize_blocks(format: str, data: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The gguf package's own dequantization (numpy) of block bytes [rows, bytes]."""
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(data.numpy(), GGMLQuantizationType[format])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def _float_tensor(format: str, data: np.ndarray) -> torch.Tensor:
    if format == "BF16":  # raw bytes: two per value
        return torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(data))


def hf_name(name: str) -> tuple[str, int | None]:
    """(Hugging Face name, expert index or None) of a GGUF tensor name; ("", None) for
    tensors the models compute themselves."""
    stem, _, kind = name.rpartition(".")
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{kind}", None
    match = _LAYER.match(name)
    if match is None:
        return "", None
    layer, part, expert, kind = match.groups()
    prefix = f"model.layers.{layer}"
    if part.endswith("_exps") or expert is not None:
        return f"{prefix}.block_sparse_moe.experts.{{}}.{EXPERT_NAMES[part]}.{kind}", (
            int(expert) if expert is not None else None)
    if part not in LAYER_NAMES:
        raise ValueError(f"GGUF tensor {name!r} has no counterpart in tokenmill's models")
    return f"{prefix}.{LAYER_NAMES[part]}.{kind}", None


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's rotary permutation of a Q or K projection."""
    head_dim = rows // heads
    permuted = torch.arange(rows).reshape(heads, 2, head_dim // 2).transpose(1, 2).reshape(-1)
    return torch.argsort(permuted)


class GGUFCheckpoint:
    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"model: {str(self.path)!r} is not a file")
        self.reader = GGUFReader(str(self.path))
        self.architecture = self.field("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"model: GGUF architecture {self.architecture!r} is not "
                             f"supported (one of {tuple(ARCHITECTURES)})")
        self.tensors = {t.name: t for t in self.reader.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        found = self.reader.fields.get(key)
        return found.contents() if found is not None else default

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{key}", default)

    def hf_config(self) -> dict[str, Any]:
        if "rope_freqs.weight" in self.tensors or self.arch_field(
                "rope.scaling.type", "none") not in ("none", None):
            raise ValueError("model: GGUF rope scaling (rope_freqs, rope.scaling.*) is not "
                             "supported")
        experts = int(self.arch_field("expert_count", 0) or 0)
        architecture, model_type = (("MixtralForCausalLM", "mixtral") if experts
                                    else ARCHITECTURES[self.architecture])
        hidden = int(self.arch_field("embedding_length"))
        heads = int(self.arch_field("attention.head_count"))
        return {
            "architectures": [architecture], "model_type": model_type,
            "vocab_size": int(self.tensors["token_embd.weight"].shape[1]),
            "hidden_size": hidden,
            "intermediate_size": int(self.arch_field("feed_forward_length", 0)
                                     or self.arch_field("expert_feed_forward_length")),
            "num_hidden_layers": int(self.arch_field("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.arch_field("attention.head_count_kv", heads)),
            "head_dim": int(self.arch_field("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(self.arch_field("context_length", 2048)),
            "rope_theta": float(self.arch_field("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_output.bias" in self.tensors,
            "num_local_experts": experts,
            "num_experts_per_tok": int(self.arch_field("expert_used_count", 0) or 0),
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
        }

    def generation_config(self) -> dict[str, Any]:
        ids = {"bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
               "eos_token_id": self.field("tokenizer.ggml.eos_token_id")}
        return {k: int(v) for k, v in ids.items() if v is not None}

    def _unpermute(self, name: str, tensor):
        if self.architecture not in PERMUTED_QK:
            return tensor
        heads = {"q_proj": self.arch_field("attention.head_count"),
                 "k_proj": self.arch_field("attention.head_count_kv",
                                           self.arch_field("attention.head_count"))}
        kind = name.rsplit(".", 2)[-2]
        if kind not in heads:
            return tensor
        order = unpermute_rows(tensor.shape[0], int(heads[kind]))
        return tensor.rows(order) if isinstance(tensor, BlockTensor) else tensor[order]

    def _tensor(self, reader_tensor, data: np.ndarray, linear: bool):
        format = reader_tensor.tensor_type.name
        if format in FLOAT_FORMATS:
            return _float_tensor(format, data)
        rows, columns = data.shape[0], int(reader_tensor.shape[0])
        blocks = BlockTensor(format, torch.from_numpy(np.array(data)), (rows, columns),
                             dequantize_blocks)
        if linear:
            return blocks
        logger.info("GGUF: %s (%s) dequantized to float at load", reader_tensor.name, format)
        return blocks.dequantize()

    def weights(self, tied: bool) -> Iterator[tuple[str, torch.Tensor | BlockTensor]]:
        """(Hugging Face name, tensor) for every tensor the model loads."""
        for name, reader_tensor in self.tensors.items():
            target, expert = hf_name(name)
            if not target:
                continue
            linear = target.endswith(".weight") and not target.endswith(
                ("norm.weight", "layernorm.weight")) and (tied or "embed_tokens" not in target)
            if "{}" not in target:
                yield target, self._unpermute(target, self._tensor(reader_tensor,
                                                                   reader_tensor.data, linear))
                continue
            stacked = reader_tensor.data if expert is None else reader_tensor.data[None]
            for index, data in enumerate(stacked):
                yield target.format(index if expert is None else expert), self._tensor(
                    reader_tensor, data, linear)

    def tensor_formats(self) -> dict[str, str]:
        """Hugging Face weight name -> GGUF format (experts one entry per expert)."""
        formats = {}
        for name, reader_tensor in self.tensors.items():
            target, expert = hf_name(name)
            if not target or not target.endswith(".weight"):
                continue
            count = reader_tensor.data.shape[0] if "{}" in target and expert is None else 1
            for index in range(count):
                formats[target.format(expert if expert is not None else index)] = (
                    reader_tensor.tensor_type.name)
        return formats
