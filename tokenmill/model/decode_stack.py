"""A decode step's decoder layers in one compiled call (csrc/decode_stack.cpp).

At a decode step's few rows each layer's own Python (module calls, each product's
method dispatch, the checks before every kernel, the residual handling) runs between
products whose weight streams have just flushed the caches: interpreter work run
cold, ~6-7 ms of a 72 ms one-row step on the 0.5B shape (benchmarks/
bench_decode_split.py --flush). The stack makes the same kernel calls, with the same
tensors in the same order, from one C++ loop: the products, norms and the backend's
whole-step attention are reached through the entry points their modules export
(layers/csrc/shared/entry_points.h). The result is bit-identical to the layers' path,
so it is no switch: it is taken wherever it reproduces that path exactly, namely

- a Llama-family model (Llama, Mistral, Qwen2: no q/k norms, the gated MLP) on one
  rank, with its final norm (the last pipeline stage, or no pipeline), every layer of
  one shape and every product's width a multiple of 16 (the step's activations live in
  one set of buffers the stack keeps from step to step, each product writing a whole
  buffer: a tensor made between two weight streams cost ~10 us of cache misses, ~250
  of them a step);
- every product of the layers on the native kernel (`--cpu-blas native`, or `auto`
  choosing it), the row operators built;
- a backend that offers the step whole with an entry point (`paged-native` on a
  float32 CPU cache: decode-only steps);
- inference (no autograd), no hooks on the layers, and the layers' methods as defined
  (a benchmark that patches Linear.forward to time or replace the products, a test
  spying on a layer, sees the layers' path).

Everything else takes the layers' path unchanged. The stack is built by the model
runner once the KV caches exist (as the model's `decode_stack`) (the kernel compiles there, once per CPU and torch
version, not in the first request).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tokenmill.attention.base import AttentionBackend, AttentionContext
from tokenmill.kv import KVCache
from tokenmill.layers import native_linear
from tokenmill.layers.linear import Linear
from tokenmill.layers.native import build_extension, native_row_ops
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.parallel import SINGLE_RANK
from tokenmill.model.llama import Attention, DecoderLayer, GatedMLP, LlamaForCausalLM

SOURCE = Path(__file__).resolve().parent / "csrc" / "decode_stack.cpp"


@functools.cache  # (no arguments: a lookup costs nothing)
def library():
    """The compiled stack, or None where it cannot be built."""
    return build_extension("decode_stack", SOURCE)


# (class, method, the method as defined) for every method whose work the stack's loop
# does: one patched since (a benchmark timing products, a test spying on a layer) means
# the layers' path, so the patch sees its calls.
_REPRODUCED = tuple(
    (cls, name, getattr(cls, name)) for cls, names in (
        (Linear, ("forward",)), (native_linear.NativeLinearMethod, ("apply", "apply_silu_mul")),
        (RMSNorm, ("forward", "add_and_norm")), (Attention, ("forward",)),
        (GatedMLP, ("forward", "_forward")), (DecoderLayer, ("forward",)))
    for name in names)


def _unpatched() -> bool:
    return all(getattr(cls, name) is method for cls, name, method in _REPRODUCED)


def first_shapes(inner: torch.nn.Module) -> list[tuple[int, int]]:
    attn, mlp = inner.layers[0].self_attn, inner.layers[0].mlp
    return [(p.out_features, p.in_features)
            for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]


def _suits(model: LlamaForCausalLM) -> bool:
    """Whether the model's layers are exactly what the stack's loop does."""
    inner = model.model
    if inner.norm is None or inner.group is not SINGLE_RANK or not len(inner.layers):
        return False
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (type(layer) is not DecoderLayer or type(attn) is not Attention
                or type(mlp) is not GatedMLP or attn.q_norm is not None
                or layer.group is not SINGLE_RANK):
            return False
        products = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(p.method is not native_linear.NATIVE for p in products):
            return False
        # One set of activation buffers serves every layer, each product's outputs
        # filling its packed blocks.
        shapes = [(p.out_features, p.in_features) for p in products]
        if any(out % native_linear.LANES for out, _ in shapes) or shapes != first_shapes(inner):
            return False
        if not native_linear.fuses_silu_mul(mlp.gate_up_proj.out_features):
            return False
    norms = [n for layer in inner.layers
             for n in (layer.input_layernorm, layer.post_attention_layernorm)] + [inner.norm]
    return all(n.weight.dtype == torch.float32 and n.weight.device.type == "cpu"
               and n.weight.is_contiguous() for n in norms)


class DecodeStack:
    """The compiled loop over one model's layers, with its pools; `run_step` per step."""

    def __init__(self, model: LlamaForCausalLM, kernel, entries: dict[str, int]) -> None:
        inner = model.model
        self.kernel = kernel.Stack(entries, inner.norm.weight.detach(), inner.norm.eps)
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            products = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            self.kernel.add_layer(
                layer.input_layernorm.weight.detach(), layer.input_layernorm.eps,
                layer.post_attention_layernorm.weight.detach(),
                layer.post_attention_layernorm.eps, attn.num_heads, attn.scale,
                [p.native_weight for p in products], [p.native_bias for p in products],
                [p.out_features for p in products])
        self.mlps = [layer.mlp for layer in inner.layers]
        # Every module a hook could sit on: one there means the layers' path. Their hook
        # dicts, gathered once (registering a hook adds to a module's dict; torch never
        # swaps the dict): asked module by module, the check took ~0.24 ms of a step,
        # its ~440 lookups missing the caches after the weights' stream; ~0.035 ms so.
        self.modules = [m for layer in inner.layers for m in layer.modules()] + [inner.norm]
        self.hook_dicts = [hooks for m in self.modules
                           for hooks in (m._forward_hooks, m._forward_pre_hooks)]
        self.caches: list[KVCache] | None = None

    @classmethod
    def build(cls, model: torch.nn.Module, backend: AttentionBackend,
              kv_caches: list[KVCache]) -> DecodeStack | None:
        """The stack for this model and backend, or None where it would not reproduce
        the layers' path (see the module's docstring)."""
        if (not isinstance(model, LlamaForCausalLM) or backend.decode_pools(kv_caches) is None
                or not _suits(model)):
            return None
        if native_row_ops() is None or library() is None:
            return None
        entries = {**native_linear.library().entry_points(),
                   **native_row_ops().entry_points()}
        return cls(model, library(), entries)

    def takes(self, hidden: torch.Tensor, attention: AttentionContext) -> bool:
        """Whether this step can run here (asked once per step)."""
        if (torch.is_grad_enabled() or not _unpatched()
                or hidden.dtype != torch.float32 or not hidden.is_contiguous()
                or attention.kv_caches is None or not attention.whole_decode):
            return False
        rows = hidden.shape[0]  # (one row is never sliced)
        if rows > 1 and any(0 < mlp.slice_rows < rows for mlp in self.mlps):
            return False
        hooks = torch.nn.modules.module
        return not (hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                    or any(self.hook_dicts))

    def run_step(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 attention: AttentionContext) -> torch.Tensor | None:
        """The final norm's output for the step's embedded tokens, or None where the
        backend gave no entry point for it (the caller takes the layers' path)."""
        entry = attention.backend.decode_entry(attention.metadata)
        if entry is None:
            return None
        if attention.kv_caches is not self.caches:
            pools = attention.backend.decode_pools(attention.kv_caches)
            if pools is None:
                return None
            self.kernel.set_pools(*pools)
            self.caches = attention.kv_caches
        address, slots, tables, lengths = entry
        return self.kernel.run(hidden, rope[0], rope[1], address, slots, tables, lengths)
