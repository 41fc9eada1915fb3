"""Attention backend interface and the per-step metadata every backend reads.

The batch is one flattened sequence of tokens: all decode tokens first (one per
request, or one plus its speculative tokens), then each prefill chunk. The metadata says where each request's tokens
sit and which KV blocks hold its context; it is built once per step by the model
runner and passed down explicitly (no globals).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from tokenmill.kv import KVCache


@dataclass
class PrefillChunk:
    """One request's chunk of new tokens beyond its cached context."""

    start: int  # offset of the chunk in the flattened batch
    end: int
    context_len: int  # tokens already in the KV cache before this chunk
    block_table: torch.Tensor  # [num_blocks] physical block ids

    @property
    def seq_len(self) -> int:
        return self.context_len + self.end - self.start


@dataclass
class AttentionMetadata:
    # Physical cache slot (block_id * block_size + offset) of every token in the batch.
    slot_mapping: torch.Tensor  # [T] int64
    num_decode_tokens: int
    # Decode rows (tokens [0, num_decode_tokens)): padded block tables and lengths.
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] int64
    decode_seq_lens: torch.Tensor | None  # [D] int64
    # [D, 1, Q, max_blocks * block_size]: True where query q of a row may see a key.
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    # Decode rows carry up to Q tokens (the last real token plus speculative ones).
    # With Q > 1, row i's tokens sit at padded positions decode_query_index (i * Q + r)
    # of a [D * Q] query grid.
    decode_query_len: int = 1
    decode_query_index: torch.Tensor | None = None
    # decode_mask laid out for the attention backend's grouped query rows, by group
    # size (filled by the backend on the first layer of a step, reused by the rest).
    grouped_masks: dict[int, torch.Tensor] = field(default_factory=dict)


class AttentionBackend(ABC):
    """Computes attention for one layer and writes the new K/V into the paged cache."""

    name: str

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, metadata: AttentionMetadata, scale: float
                ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: this layer's paged cache.

        Writes k, v into the cache (quantizing them if the cache is quantized) and
        returns the attention output [T, H, D]. Every key/value a query attends to,
        including its own chunk's, must be read as the cache holds it, so that a
        token's output does not depend on how the batch was chunked.
        """
