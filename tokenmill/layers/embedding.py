"""The token embedding, split over the tensor-parallel group by vocabulary rows: each
rank holds vocab_size / size rows, looks up the tokens in its range (zeros for the
others), and an all-reduce assembles the embeddings. With one rank it is a plain
embedding lookup."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.layers.parallel import SINGLE_RANK, Collectives


def masked_lookup(lookup: Callable[[torch.Tensor], torch.Tensor], local_rows: int,
                  token_ids: torch.Tensor, group: Collectives) -> torch.Tensor:
    """Embeddings of token ids of the whole vocabulary when this rank holds rows
    [rank * local_rows, (rank + 1) * local_rows) of the table (lookup(local ids) reads
    them): the others are zero here and filled in by the all-reduce."""
    if group.size == 1:
        return lookup(token_ids)
    local = token_ids - group.rank * local_rows
    outside = (local < 0) | (local >= local_rows)
    rows = lookup(local.masked_fill(outside, 0))
    return group.all_reduce(rows.masked_fill(outside[:, None], 0.0))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        # vocab_size is this rank's share (the model is built from the rank's geometry).
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.group: Collectives = SINGLE_RANK

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return masked_lookup(lambda ids: self.weight.index_select(0, ids), self.weight.shape[0],
                             token_ids, self.group)

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, rows: slice | None = None) -> None:
        """Copy this rank's rows of the full checkpoint table."""
        local = self.weight.shape[0]
        shard = tensor[self.group.rank * local:(self.group.rank + 1) * local]
        if shard.shape != self.weight.shape:
            raise ValueError(f"shape {tuple(tensor.shape)} does not fit "
                             f"{self.group.size} x {tuple(self.weight.shape)}")
        self.weight.copy_(shard)
