"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flattened varlen batch.

Differences between the families are config switches: q/k/v biases (Qwen2), per-head
q/k RMSNorm and explicit head_dim (Qwen3), rope scaling (Llama 3), tied embeddings.
Q/K/V and gate/up projections are fused; checkpoint tensors are placed into the
fused weights through `STACKED_PARAMS`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.base import AttentionBackend, AttentionMetadata
from tokenmill.kv import KVCache
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary
from tokenmill.model.arch import ArchConfig

# checkpoint projection -> (fused parameter, shard name)
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads, arch.num_kv_heads, arch.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.scale = self.head_dim ** -0.5

    def shard_slice(self, shard: str) -> slice:
        offsets = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                   "v": (self.q_size + self.kv_size, self.kv_size)}
        start, size = offsets[shard]
        return slice(start, start + size)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                kv_cache: KVCache, metadata: AttentionMetadata, backend: AttentionBackend
                ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        out = backend.forward(q, k, v.contiguous(), kv_cache, metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def shard_slice(self, shard: str) -> slice:
        size = self.intermediate_size
        return slice(0, size) if shard == "gate" else slice(size, 2 * size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                kv_cache: KVCache, metadata: AttentionMetadata, backend: AttentionBackend
                ) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv_cache,
                                         metadata, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama, Mistral, Qwen2 and Qwen3 checkpoints."""

    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        super().__init__()
        if arch.hidden_act != "silu":
            raise ValueError(f"hidden_act {arch.hidden_act!r} is not supported (only 'silu')")
        self.arch = arch
        self.model = LlamaModel(arch, max_positions)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after moving devices, which unties)."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def post_load(self) -> None:
        """Build non-persistent tables once the module sits on its device."""
        self.model.rotary.build_cache()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], metadata: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """Final hidden states [T, hidden] for a flattened batch of T tokens."""
        hidden = self.model.embed_tokens(input_ids)
        rope = self.model.rotary(positions, hidden.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden = layer(rope, hidden, kv_cache, metadata, backend)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the (fused) parameters; returns the names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if self.arch.tie_word_embeddings and name == "lm_head.weight":
                continue
            target, rows = self._locate(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target]
            dest = param.data if rows is None else param.data[rows]
            if dest.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(f"{target}[{rows.start}:{rows.stop}]" if rows is not None else target)
        return loaded

    def _locate(self, name: str) -> tuple[str, slice | None]:
        """Map a checkpoint name to (parameter name, rows of a fused parameter)."""
        for ckpt_part, (fused, shard) in STACKED_PARAMS.items():
            if f".{ckpt_part}." in name:
                target = name.replace(ckpt_part, fused)
                owner = self.get_submodule(target.rsplit(".", 2)[0])
                return target, owner.shard_slice(shard)
        return name, None

    def expected_weights(self) -> set[str]:
        """What load_weights must have filled for the model to be complete."""
        expected: set[str] = set()
        for name, _ in self.named_parameters():
            module = self.get_submodule(name.rsplit(".", 2)[0]) if "." in name else self
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                for shard in "qkv":
                    rows = module.shard_slice(shard)
                    expected.add(f"{name}[{rows.start}:{rows.stop}]")
            elif name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
                for shard in ("gate", "up"):
                    rows = module.shard_slice(shard)
                    expected.add(f"{name}[{rows.start}:{rows.stop}]")
            else:
                expected.add(name)
        return expected
