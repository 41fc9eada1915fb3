"""The attention-backend seam: a neutral batch layout in, each backend's own metadata
and per-layer state behind it.

The model runner describes a step's flattened batch once (`BatchLayout`: where each
request's tokens sit, how much context each has cached, which blocks hold it, the
slot every new token's K/V goes to). A backend turns that into whatever metadata it
needs (`build_metadata`), may keep per-layer state beside the paged KV cache
(`allocate_state`), and computes one layer's attention given the layer's index. The
model only calls `AttentionContext(layer_index, q, k, v, scale)` (or first offers a
step whole, `decode_qkv` with the layer's fused projection, which a backend may
decline): it never knows which backend runs, so a new backend is a new file plus a
registry entry (attention/registry.py).

Batch order: requests in decode state first (one real token on a cached context, plus
its speculative tokens), then prefill chunks.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.kv import KVCache


@dataclass(frozen=True)
class SparseSettings:
    """What the sparse backends read (AttentionConfig's sparse_* knobs, documented there)."""

    budget: int = 1024
    dense_layers: int = 2
    top_p: float = 0.9
    min_tokens: int = 64
    sink_tokens: int = 32
    window: int = 256
    retrieval_fraction: float = 0.15
    calibration: str | None = None  # path of a sparse_calibration.json
    min_context: int | None = None  # None: measured on this machine (crossover.py)
    prefill: bool = False  # prefill chunks on a long context attend sparsely too


@dataclass(frozen=True)
class AttentionSpec:
    """The geometry a backend is built for."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    sparse: SparseSettings = SparseSettings()


@dataclass
class BatchLayout:
    """A step's flattened batch as every backend sees it (built by the runner)."""

    # Offsets of each request's tokens in the batch ([R + 1]; request r owns tokens
    # query_start[r] .. query_start[r + 1] - 1).
    query_start: list[int]
    # Tokens already in the cache before this step, per request.
    context_lens: list[int]
    # Physical blocks holding each request's tokens (at least up to its new ones).
    block_tables: list[list[int]]
    # Requests [0, num_decode_requests) are decodes; the rest are prefill chunks.
    num_decode_requests: int
    # Physical cache slot (block_id * block_size + offset) of every token in the batch.
    slot_mapping: torch.Tensor  # [T] int64
    block_size: int

    @property
    def num_requests(self) -> int:
        return len(self.context_lens)

    @property
    def query_lens(self) -> list[int]:
        return [b - a for a, b in zip(self.query_start, self.query_start[1:], strict=False)]

    @property
    def num_decode_tokens(self) -> int:
        return self.query_start[self.num_decode_requests]

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device


class AttentionBackend(ABC):
    """Computes attention for one layer and writes the new K/V into the paged cache."""

    name: str

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    def allocate_state(self, kv_caches: list[KVCache]) -> None:
        """Called once with every layer's cache: allocate per-layer state beside it
        (indexed like the cache's blocks, so it is reused and freed with them)."""
        return None

    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> Any:
        """This backend's metadata for a step, built once and shared by every layer."""

    @abstractmethod
    def forward(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, metadata: Any, scale: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: this layer's paged cache.

        Writes k, v into the cache (quantizing them if the cache is quantized) and
        returns the attention output [T, H, D]. Every key/value a query attends to,
        including its own chunk's, must be read as the cache holds it, so that a
        token's output does not depend on how the batch was chunked.
        """

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, metadata: Any
                 ) -> None:
        """Only write k, v into the cache (a layer an early-exited token skips)."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot write K/V alone")

    def takes_whole_decode(self, metadata: Any) -> bool:
        """Whether this step goes whole through `decode_qkv` (asked once per step)."""
        return False

    def decode_qkv(self, layer_index: int, qkv: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor], num_heads: int,
                   kv_cache: KVCache | None, metadata: Any, scale: float
                   ) -> torch.Tensor | None:
        """A step's attention taken straight from the layer's fused projection qkv
        [T, (H + 2 KVH) D] (rotary embedding, K/V write and attention in one call),
        [T, H D], for a step `takes_whole_decode` accepted; or None where this layer's
        tensors do not suit it (the layer then splits and rotates q, k, v itself). The
        result must equal forward's."""
        return None

    def decode_pools(self, kv_caches: list[KVCache]
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Every layer's key and value pools as `decode_entry`'s function takes them, for
        a compiled decoder stack (model/decode_stack.py) that runs whole steps itself;
        None where this backend offers no entry point."""
        return None

    def decode_entry(self, metadata: Any
                     ) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For a step `takes_whole_decode` accepted: what a compiled decoder stack calls
        per layer in place of decode_qkv, the address of a C++ function of the
        `QkvDecode` type (layers/csrc/shared/entry_points.h) and the step's slot
        mapping, block tables and lengths it takes (with that layer's pools from
        `decode_pools`); None where this backend has none. The function must do what
        decode_qkv does."""
        return None


@dataclass
class AttentionContext:
    """What a model's attention layers call for one forward: the backend, its metadata
    for this step and every layer's cache (None where a backend needs no cache)."""

    backend: AttentionBackend
    metadata: Any
    kv_caches: list[KVCache] | None

    def __call__(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        cache = self.kv_caches[layer_index] if self.kv_caches is not None else None
        return self.backend.forward(layer_index, q, k, v, cache, self.metadata, scale)

    def write(self, layer_index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.backend.write_kv(k, v, self.kv_caches[layer_index], self.metadata)

    @functools.cached_property
    def whole_decode(self) -> bool:
        """Whether the layers offer this step whole (`decode_qkv`): a flag per step, so
        that a step the backend would decline costs each layer no call."""
        return self.backend.takes_whole_decode(self.metadata)

    def decode_qkv(self, layer_index: int, qkv: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor], num_heads: int,
                   scale: float) -> torch.Tensor | None:
        cache = self.kv_caches[layer_index] if self.kv_caches is not None else None
        return self.backend.decode_qkv(layer_index, qkv, rope, num_heads, cache,
                                       self.metadata, scale)
