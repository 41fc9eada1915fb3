"""Tensor parallelism as linear methods (Megatron's layout): a layer built for one
rank holds its shard; the method loads that shard from the full checkpoint tensor and
adds the collective its style needs.

    column       QKV, gate/up: outputs split; each rank computes its heads / columns
    row          o_proj, down_proj: inputs split; partial products all-reduced (or,
                 with sequence parallelism, reduce-scattered over tokens)
    row_partial  an MoE expert's down_proj: like row, the MoE layer reduces once
    vocab        the LM head: outputs split over the vocabulary, then all-gathered;
                 a tied head doubles as a vocab-parallel embedding

Shards are taken where a rank's rows sit in the checkpoint tensor: shard i of
n = rows / local_rows, with i = rank * n / size, so KV heads fewer than ranks are
replicated (ranks 2k and 2k + 1 both take KV head k with 2 heads on 4 ranks). A row
layer's bias is added by rank 0 only, so the sum counts it once.
"""

from __future__ import annotations

import torch

from tokenmill.layers.embedding import masked_lookup
from tokenmill.layers.linear import Linear, LinearSelector
from tokenmill.layers.linear_method import LinearMethod
from tokenmill.layers.parallel import Collectives


def _shard(tensor: torch.Tensor, local: int, dim: int, group: Collectives) -> torch.Tensor:
    """This rank's `local` rows (dim 0) or columns (dim 1) of a full tensor."""
    full = tensor.shape[dim]
    if full % local:
        raise ValueError(f"a checkpoint dimension of {full} does not split into shards of "
                         f"{local}")
    index = group.rank * (full // local) // group.size
    return tensor.narrow(dim, index * local, local)


class TensorParallelMethod(LinearMethod):
    def __init__(self, inner: LinearMethod, style: str, group: Collectives) -> None:
        self.inner = inner
        self.style = style
        self.group = group
        self.name = f"{inner.name}+tp-{style}"

    def create_weights(self, layer: Linear) -> None:
        self.inner.create_weights(layer)

    def load_weight(self, layer: Linear, tensor: torch.Tensor, rows: slice) -> None:
        if self.style in ("row", "row_partial"):
            tensor = _shard(tensor, layer.in_features, 1, self.group)
        else:
            tensor = _shard(tensor, rows.stop - rows.start, 0, self.group)
        self.inner.load_weight(layer, tensor, rows)

    def load_bias(self, layer: Linear, tensor: torch.Tensor, rows: slice) -> None:
        if self.style in ("row", "row_partial"):
            # Every rank's partial product would carry it: rank 0's alone counts.
            tensor = tensor if self.group.rank == 0 else torch.zeros_like(tensor)
        else:
            tensor = _shard(tensor, rows.stop - rows.start, 0, self.group)
        self.inner.load_bias(layer, tensor, rows)

    def finalize(self, layer: Linear) -> None:
        self.inner.finalize(layer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = self.inner.apply(layer, x)
        if self.style == "row":
            return self.group.reduce_partial(out)
        if self.style == "vocab":
            return self.group.all_gather(out)
        return out

    def embedding(self, layer: Linear, token_ids: torch.Tensor) -> torch.Tensor:
        """A tied LM head's rows, for token ids of the whole vocabulary."""
        if self.style != "vocab":
            raise ValueError(f"a {self.style}-parallel layer is not an embedding table")
        return masked_lookup(lambda ids: self.inner.embedding(layer, ids), layer.out_features,
                             token_ids, self.group)

    def checkpoint_weight(self, layer: Linear) -> torch.Tensor:
        raise ValueError("a tensor-parallel shard is not a checkpoint weight")

    def weight_bytes(self, layer: Linear) -> int:
        return self.inner.weight_bytes(layer)


def tensor_parallel_selector(select: LinearSelector, group: Collectives) -> LinearSelector:
    """`select`'s methods, each wrapped for its layer's parallel style on `group`."""
    if group.size == 1:
        return select

    def choose(name: str, layer: Linear) -> LinearMethod:
        inner = select(name, layer)
        if layer.parallel is None:
            return inner
        return TensorParallelMethod(inner, layer.parallel, group)

    return choose
