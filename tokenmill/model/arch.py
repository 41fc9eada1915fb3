"""The shape of a checkpoint, read from its config.json (any transformers version)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

QWEN2_TYPES = ("qwen2", "qwen2_moe")
QWEN_TYPES = QWEN2_TYPES + ("qwen3", "qwen3_moe")


def _dense_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """Qwen-MoE layers with a dense MLP: those listed in mlp_only_layers, and all but
    every decoder_sparse_step-th."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or ())
    return tuple(i for i in range(int(cfg["num_hidden_layers"]))
                 if i in only or (i + 1) % step)


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict[str, Any]
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Mixture of experts (0 for dense models).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    # Qwen2-MoE / Qwen3-MoE: each expert's width (0: intermediate_size, Mixtral's), a
    # shared expert's (0: none), whether the top-k weights are renormalised, and the
    # layers that keep a dense MLP of intermediate_size.
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    # The index of this model's first layer in the whole model (a pipeline stage's).
    first_layer: int = 0
    # Expert parallelism: the expert each of this rank's slots holds, whole; None: all.
    expert_slots: tuple[int, ...] | None = None
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ArchConfig:
        architectures = cfg.get("architectures") or []
        if not architectures:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        model_type = cfg.get("model_type", "")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding = cfg.get("sliding_window")
        if model_type in QWEN_TYPES and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=architectures[0],
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=_rope_parameters(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 (and Qwen2-MoE) always has q/k/v biases and no o_proj bias; the others follow
            # attention_bias for all four projections.
            qkv_bias=model_type in QWEN2_TYPES or bool(cfg.get("attention_bias", False)),
            o_proj_bias=model_type not in QWEN2_TYPES and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            hidden_act=cfg.get("hidden_act", "silu"),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            dense_layers=_dense_layers(cfg),
            raw=cfg,
        )


    def sharded(self, size: int, expert_rank: int | None = None,
                expert_slots: tuple[int, ...] | None = None) -> ArchConfig:
        """One tensor-parallel rank's geometry: its heads, MLP columns and vocabulary
        rows (KV heads fewer than ranks are replicated: one per rank). ValueError
        naming tensor_parallel_size when the model does not split that way.

        expert_rank: expert parallelism; the rank holds experts whole, E / size of them
        (a shared expert replicated), rather than a column shard of each: a contiguous
        block, or `expert_slots` (replicas of hot experts, dist/expert_replicas.py)."""
        if size == 1:
            return self
        if expert_rank is not None:
            if not self.num_experts or self.num_experts % size:
                raise ValueError(f"expert_parallel needs a mixture of experts whose "
                                 f"{self.num_experts} experts split over "
                                 f"tensor_parallel_size {size}")
            per_rank = self.num_experts // size
            slots = expert_slots or tuple(range(expert_rank * per_rank,
                                                (expert_rank + 1) * per_rank))
            # The shared expert is replicated, so its width need not split.
            whole = dataclasses.replace(
                self, moe_intermediate_size=self.moe_intermediate_size or self.intermediate_size,
                shared_expert_intermediate_size=0, expert_slots=slots)
            return dataclasses.replace(
                whole.sharded(size), moe_intermediate_size=whole.moe_intermediate_size,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        kv_ok = self.num_kv_heads % size == 0 or size % self.num_kv_heads == 0
        splits = {"attention heads": self.num_heads % size == 0, "KV heads": kv_ok,
                  "MLP width": self.intermediate_size % size == 0,
                  "expert width": self.moe_intermediate_size % size == 0,
                  "shared expert width": self.shared_expert_intermediate_size % size == 0,
                  "vocabulary": self.vocab_size % size == 0}
        bad = [name for name, ok in splits.items() if not ok]
        if bad:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's "
                             f"{', '.join(bad)} ({self.num_heads} heads, {self.num_kv_heads} "
                             f"KV heads, {self.intermediate_size} MLP, {self.vocab_size} vocab)")
        return dataclasses.replace(
            self, num_heads=self.num_heads // size,
            num_kv_heads=max(self.num_kv_heads // size, 1),
            intermediate_size=self.intermediate_size // size, vocab_size=self.vocab_size // size,
            moe_intermediate_size=self.moe_intermediate_size // size,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size // size)

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (of the whole model) has experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def layer_parameters(self) -> int:
        """Parameters of one decoder layer (attention, MLP or experts and router, norms);
        a model with dense and sparse layers: its mean layer."""
        return sum(self.parameters_of_layer(i) for i in range(self.num_layers)) // max(
            self.num_layers, 1)

    def parameters_of_layer(self, index: int) -> int:
        hidden, inter = self.hidden_size, self.intermediate_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        mlp = 3 * hidden * inter
        if self.is_sparse(self.first_layer + index):
            expert = 3 * hidden * (self.moe_intermediate_size or inter)
            held = len(self.expert_slots) if self.expert_slots else self.num_experts
            mlp = held * expert + self.num_experts * hidden  # experts + router rows
            if self.shared_expert_intermediate_size:  # and its gate
                mlp += 3 * hidden * self.shared_expert_intermediate_size + hidden
        layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + mlp + 2 * hidden
        if self.qkv_bias:
            layer += q_size + 2 * kv_size
        if self.o_proj_bias:
            layer += hidden
        if self.mlp_bias:
            layer += 2 * inter + hidden
        if self.qk_norm:
            layer += 2 * self.head_dim
        return layer

    @property
    def num_parameters(self) -> int:
        """Parameters of the whole decoder (dense or Mixtral MoE), counted from its shape."""
        embed = self.vocab_size * self.hidden_size
        return (embed * (1 if self.tie_word_embeddings else 2)
                + sum(self.parameters_of_layer(i) for i in range(self.num_layers))
                + self.hidden_size)


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """Merge the two spellings: `rope_parameters` (transformers 5) and `rope_theta` +
    `rope_scaling` (earlier releases)."""
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    rope.update({k: v for k, v in scaling.items() if k not in rope})
    if "rope_theta" not in rope:
        rope["rope_theta"] = cfg.get("rope_theta", 10000.0)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    return rope
