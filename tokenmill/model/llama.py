"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flattened varlen batch.

Differences between the families are config switches: q/k/v biases (Qwen2), per-head
q/k RMSNorm and explicit head_dim (Qwen3), rope scaling (Llama 3), tied embeddings.
Q/K/V and gate/up projections are fused; checkpoint tensors are placed into the
fused weights through `STACKED_PARAMS`. For tensor parallelism the model is built
from one rank's geometry (ArchConfig.sharded) and each projection declares how it
splits (Megatron's layout: QKV and gate/up by columns, o_proj and down_proj by rows,
the LM head and embedding by vocabulary); the linear methods do the rest. With
sequence parallelism (layers/parallel.py) the residual stream holds one rank's share
of the tokens: norms and residual adds run on it, projections on all the tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.attention.base import AttentionContext
from tokenmill.layers.embedding import VocabParallelEmbedding
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.parallel import SINGLE_RANK, Collectives
from tokenmill.layers.rotary import RotaryEmbedding, rotate
from tokenmill.layers.row_slices import in_row_slices
from tokenmill.model.arch import ArchConfig

_EXPERT = re.compile(r"\.experts\.(\d+)\.")

# checkpoint projection -> (fused parameter, shard name)
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads, arch.num_kv_heads, arch.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_out = self.q_size + 2 * self.kv_size
        self.qkv_proj = Linear(arch.hidden_size, qkv_out, arch.qkv_bias, parallel="column")
        self.o_proj = Linear(self.q_size, arch.hidden_size, arch.o_proj_bias, parallel="row")
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.scale = self.head_dim ** -0.5

    def shard_slice(self, shard: str) -> slice:
        offsets = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                   "v": (self.q_size + self.kv_size, self.kv_size)}
        start, size = offsets[shard]
        return slice(start, start + size)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                attention: AttentionContext) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.q_norm is None and attention.whole_decode:
            # A decode step on a backend that takes it whole: rotation, K/V write and
            # attention in one call (the split and rotation below cost more than the
            # attention itself at a few rows, run cold after the weights' stream).
            out = attention.decode_qkv(self.layer_index, qkv, rope, self.num_heads, self.scale)
            if out is not None:
                return self.o_proj(out)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = rotate(q, rope), rotate(k, rope)
        else:
            # Q and K sit side by side in each row: one rotation for both heads' kinds
            # (half the small ops a decode step spends on rope; the same arithmetic).
            qk = qkv[:, :self.q_size + self.kv_size].view(
                num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = rotate(qk, rope).split((self.num_heads, self.num_kv_heads), dim=1)
        out = attention(self.layer_index, q, k, v.contiguous(), self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, parallel="column")
        self.down_proj = Linear(intermediate_size, hidden_size, bias, parallel="row")
        # Rows of a large batch run through at a time in inference (0: all at once);
        # the worker sets it (layers/row_slices.py).
        self.slice_rows = 0

    def shard_slice(self, shard: str) -> slice:
        size = self.intermediate_size
        return slice(0, size) if shard == "gate" else slice(size, 2 * size)

    def intermediate_bytes_per_row(self, itemsize: int) -> int:
        """Bytes of one row's widest intermediate (the fused gate/up output)."""
        return self.gate_up_proj.out_features * itemsize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if 0 < self.slice_rows < x.shape[0] and not torch.is_grad_enabled():
            return in_row_slices(self._forward, x, self.slice_rows, self.down_proj.out_features)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x, silu_mul=True))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, mlp: nn.Module, layer_index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(arch, layer_index)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # Sequence parallelism: `hidden` is this rank's tokens; the projections see all.
        self.group: Collectives = SINGLE_RANK

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                attention: AttentionContext, pending: torch.Tensor | None = None,
                defer: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The layer's output, hidden + its MLP's. With `defer`, (hidden, the MLP's output)
        instead: the residual add is left to the next layer, given it as `pending`, whose
        input norm adds it in the same compiled call (add_and_norm rounds the sum as
        torch's add does). A separate add per layer ran cold after the weights' stream."""
        if pending is None:
            x = self.input_layernorm(hidden)
        else:
            hidden, x = self.input_layernorm.add_and_norm(hidden, pending)
        x = self.group.gather_tokens(x)
        hidden, x = self.post_attention_layernorm.add_and_norm(
            hidden, self.self_attn(rope, x, attention))
        if not getattr(self.mlp, "all_to_all", False):  # EP under SP takes its share
            x = self.group.gather_tokens(x)
        if defer:
            return hidden, self.mlp(x)
        return hidden + self.mlp(x)


class LlamaModel(nn.Module):
    def __init__(self, arch: ArchConfig, max_positions: int,
                 build_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        # A tied embedding lives in the LM head (see LlamaForCausalLM.embed).
        self.embed_tokens = (None if arch.tie_word_embeddings
                             else VocabParallelEmbedding(arch.vocab_size, arch.hidden_size))
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope)
        # build_mlp takes the layer's index in the whole model (a pipeline stage's
        # layers are numbered from 0 here, from arch.first_layer there).
        self.layers = nn.ModuleList(DecoderLayer(arch, build_mlp(arch.first_layer + index), index)
                                    for index in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.group: Collectives = SINGLE_RANK


class LlamaForCausalLM(nn.Module):
    """Llama, Mistral, Qwen2 and Qwen3 checkpoints."""

    # checkpoint projection -> (fused parameter, shard name)
    STACKED_PARAMS = STACKED_PARAMS

    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        super().__init__()
        if arch.hidden_act != "silu":
            raise ValueError(f"hidden_act {arch.hidden_act!r} is not supported (only 'silu')")
        self.arch = arch
        self.model = LlamaModel(arch, max_positions, lambda layer: self.build_mlp(arch, layer))
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, False, parallel="vocab")
        # Tied: the LM head's weight is also the embedding table (see embed).
        self.lm_head.keep_weight = arch.tie_word_embeddings
        # Decode-only steps through one compiled call: the model runner sets a
        # model/decode_stack.py DecodeStack where it reproduces the layers' path.
        self.decode_stack: Any = None

    @staticmethod
    def build_mlp(arch: ArchConfig, layer: int = 0) -> nn.Module:
        """The MLP of decoder layer `layer` (of the whole model)."""
        return GatedMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias)

    def post_load(self) -> None:
        """Build non-persistent tables once the module sits on its device."""
        self.model.rotary.build_cache()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.model.embed_tokens is None:
            return self.lm_head.embedding(input_ids)
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: AttentionContext, hidden: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Final hidden states [T, hidden] for a flattened batch of T tokens.

        A pipeline stage (dist/pipeline.py) other than the first is given the previous
        stage's output as `hidden`; one other than the last has no final norm and
        returns its last layer's output."""
        if hidden is None:
            hidden = self.embed(input_ids)
        rope = self.model.rotary(positions, hidden.dtype)
        stack = self.decode_stack
        if stack is not None and stack.takes(hidden, attention):
            out = stack.run_step(hidden, rope, attention)
            if out is not None:
                return out
        group = self.model.group
        hidden = group.split_tokens(hidden)
        pending = None  # the last layer's MLP output, its residual add deferred
        for layer in self.model.layers:
            hidden, pending = layer(rope, hidden, attention, pending, defer=True)
        if self.model.norm is not None:
            if pending is not None:
                _, hidden = self.model.norm.add_and_norm(hidden, pending)
            else:
                hidden = self.model.norm(hidden)
        elif pending is not None:
            hidden = hidden + pending
        return group.gather_tokens(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the (fused, possibly transposed) parameters.

        Returns what was filled, as "parameter" or "parameter[rows]" names, so the
        loader can check completeness against expected_weights().
        """
        loaded: set[str] = set()
        for checkpoint_name, checkpoint_tensor in weights:
            for name, tensor in self.split_checkpoint_tensor(checkpoint_name, checkpoint_tensor):
                for local in self._local_experts(name):
                    loaded.add(self._load_tensor(local, tensor))
        return loaded

    def _local_experts(self, name: str) -> list[str]:
        """Expert parallelism: an expert's tensor under this rank's slot numbers for it
        (none when other ranks hold it, several for replicas); other tensors as named."""
        match = _EXPERT.search(name)
        if self.arch.expert_slots is None or match is None:
            return [name]
        expert = int(match.group(1))
        return [f"{name[:match.start(1)]}{slot}{name[match.end(1):]}"
                for slot, held in enumerate(self.arch.expert_slots) if held == expert]

    def _load_tensor(self, name: str, tensor: torch.Tensor) -> str:
        if "rotary_emb" in name:
            return name
        if self.arch.tie_word_embeddings:
            if name == "lm_head.weight":
                return name  # the same tensor as the embedding
            if name == "model.embed_tokens.weight":
                name = "lm_head.weight"
        target, rows = self._locate(name)
        try:
            module_name, param_name = self._split_owner(target)
            module = self.get_submodule(module_name)
            if hasattr(module, "load"):  # layers that place (and shard) their own tensors
                module.load(param_name, tensor, rows)
            else:
                getattr(module, param_name).data.copy_(tensor)
        except (AttributeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"checkpoint tensor {name!r} "
                             f"({tuple(tensor.shape)}) does not fit the model: {exc}") from None
        return f"{target}[{rows.start}:{rows.stop}]" if rows is not None else target

    @staticmethod
    def split_checkpoint_tensor(name: str, tensor: torch.Tensor
                                ) -> Iterable[tuple[str, torch.Tensor]]:
        """Hook for checkpoint tensors that hold several of the model's (fused layouts)."""
        return ((name, tensor),)

    def _locate(self, name: str) -> tuple[str, slice | None]:
        """Map a checkpoint name to (parameter name, rows of a fused parameter)."""
        name = self.rename_checkpoint_tensor(name)
        for ckpt_part, (fused, shard) in self.STACKED_PARAMS.items():
            if f".{ckpt_part}." in name:
                target = name.replace(ckpt_part, fused)
                owner = self.get_submodule(target.rsplit(".", 2)[0])
                return target, owner.shard_slice(shard)
        return name, None

    def _split_owner(self, target: str) -> tuple[str, str]:
        """(deepest existing module, the rest of the name) for a parameter path."""
        parts = target.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:cut])
            try:
                self.get_submodule(prefix)
            except AttributeError:
                continue
            return prefix, ".".join(parts[cut:])
        raise AttributeError(f"no module owns {target!r}")

    @staticmethod
    def rename_checkpoint_tensor(name: str) -> str:
        """Hook for families whose checkpoint names differ from the module tree."""
        return name

    def expected_weights(self) -> set[str]:
        """What load_weights must have filled for the model to be complete."""
        expected: set[str] = set()
        for name, _ in self.named_parameters():
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                shards = "qkv"
            elif name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
                shards = ("gate", "up")
            else:
                expected.add(name)
                continue
            # The fused layer's owner (attention, MLP, expert) knows where each shard sits.
            module = self.get_submodule(name.rsplit(".", 2)[0])
            for shard in shards:
                rows = module.shard_slice(shard)
                expected.add(f"{name}[{rows.start}:{rows.stop}]")
        return expected
