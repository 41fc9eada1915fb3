"""Turn a step's scheduled requests into one flattened batch and run the model on it.

Layout of a batch: requests in decode state first (one real token on a cached
context, plus speculative tokens), then each prefill chunk. The runner owns the
model's paged KV caches and its attention backend; it describes the batch neutrally
(`BatchLayout`) and lets the backend build its own metadata. Used for the target
model (with `runner/sampling.py` after it) and by proposers that run a model of
their own (a draft model, an EAGLE head).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.attention.base import (
    AttentionBackend,
    AttentionContext,
    AttentionSpec,
    BatchLayout,
    SparseSettings,
)
from tokenmill.attention.registry import create_attention_backend
from tokenmill.core.step import ScheduledRequest
from tokenmill.kv import KVCache
from tokenmill.kv.quant import storage_dtype
from tokenmill.layers.native import prepare_native_row_ops
from tokenmill.model.arch import ArchConfig
from tokenmill.model.decode_stack import DecodeStack
from tokenmill.runner.early_exit import EarlyExit, forward_with_exits
from tokenmill.runner.prefill_pruning import PrefillPruning, forward_with_pruning


@dataclass
class PreparedBatch:
    # Indices into the scheduled requests, in batch order (decodes first).
    order: list[int]
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    layout: BatchLayout
    attention: AttentionContext
    request_ids: list[str] = field(default_factory=list)  # in batch order
    # Prefill pruning: batch slots of whole prompts to prune this step, and whether
    # any request of the batch runs with dropped blocks (from this step or before).
    prune: list[int] = field(default_factory=list)
    pruned: bool = False

    @property
    def query_start(self) -> list[int]:
        return self.layout.query_start


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arch: ArchConfig, num_blocks: int,
                 block_size: int, device: torch.device, dtype: torch.dtype,
                 kv_cache_dtype: str = "auto", attention_backend: str = "paged-native",
                 early_exit: EarlyExit | None = None,
                 sparse: SparseSettings | None = None,
                 pruning: PrefillPruning | None = None) -> None:
        self.model = model
        if early_exit is not None and not 1 <= early_exit.layer < arch.num_layers:
            raise ValueError(f"early_exit_layer must be in [1, {arch.num_layers - 1}] for "
                             f"this {arch.num_layers}-layer model, got {early_exit.layer}")
        self.early_exit = early_exit
        if pruning is not None and not 1 <= pruning.layer < arch.num_layers:
            raise ValueError(f"prefill_pruning_layer must be in [1, {arch.num_layers - 1}] "
                             f"for this {arch.num_layers}-layer model, got {pruning.layer}")
        self.pruning = pruning
        self.arch = arch
        self.block_size = block_size
        self.device = device
        storage = storage_dtype(kv_cache_dtype, dtype)
        self.kv_caches = [KVCache.allocate(num_blocks, block_size, arch.num_kv_heads,
                                           arch.head_dim, storage, dtype, device)
                          for _ in range(arch.num_layers)]
        spec = AttentionSpec(arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                             block_size, sparse or SparseSettings())
        self.backend: AttentionBackend = create_attention_backend(attention_backend, spec)
        self.backend.allocate_state(self.kv_caches)
        prepare_native_row_ops(device, dtype)
        if hasattr(model, "decode_stack"):  # a decode step's layers in one compiled call
            model.decode_stack = DecodeStack.build(model, self.backend, self.kv_caches)

    def prepare(self, requests: list[ScheduledRequest]) -> PreparedBatch:
        """The flattened batch: token ids, positions and the attention context."""
        order = ([i for i, r in enumerate(requests) if r.is_decode]
                 + [i for i, r in enumerate(requests) if not r.is_decode])
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        size = self.block_size
        for index in order:
            request = requests[index]
            start, table = request.num_computed_tokens, request.block_table
            tokens.extend(request.token_ids)
            for pos in range(start, start + request.num_new_tokens):
                positions.append(pos)
                slots.append(table[pos // size] * size + pos % size)
            query_start.append(len(tokens))
        device = self.device
        layout = BatchLayout(
            query_start=query_start,
            context_lens=[requests[i].num_computed_tokens for i in order],
            block_tables=[requests[i].block_table for i in order],
            num_decode_requests=sum(1 for r in requests if r.is_decode),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_size=size)
        attention = AttentionContext(self.backend, self.backend.build_metadata(layout),
                                     self.kv_caches)
        batch = PreparedBatch(order, torch.tensor(tokens, dtype=torch.int64, device=device),
                              torch.tensor(positions, dtype=torch.int64, device=device),
                              layout, attention, [requests[i].request_id for i in order])
        if self.pruning is not None:
            batch.prune, batch.pruned = self.pruning.plan(
                [requests[i] for i in order], self.block_size)
        return batch

    def forward(self, batch: PreparedBatch, hidden: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Final hidden states [T, hidden] of the batch's tokens (a pipeline stage: from
        the previous stage's `hidden`, its own last layer's output)."""
        if hidden is None:
            layout = batch.layout
            if (self.early_exit is not None and layout.num_decode_requests == len(batch.order)
                    and len(batch.token_ids) == len(batch.order)):  # plain decode tokens
                return forward_with_exits(self.model, batch.token_ids, batch.positions,
                                          batch.attention, self.early_exit)
            if batch.pruned:
                return forward_with_pruning(self.model, batch.token_ids, batch.positions,
                                            batch.attention, layout, batch.request_ids,
                                            batch.prune, self.pruning)
            return self.model(batch.token_ids, batch.positions, batch.attention)
        return self.model(batch.token_ids, batch.positions, batch.attention, hidden)

    def kv_cache_bytes(self) -> int:
        return sum(cache.nbytes for cache in self.kv_caches)
