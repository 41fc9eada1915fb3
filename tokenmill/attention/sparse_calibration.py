"""The offline calibration `retrieval-topp` reads: which KV heads retrieve, and the
few key dimensions its index scores blocks with (`tokenmill calibrate sparse` writes
it next to the model as sparse_calibration.json).

Retrieval score (attention mass on what is looked up, as in the retrieval-head
literature): the calibration runs probe sequences where some query positions must
look up some key positions, and per query head h

    r_h = mean over probe queries i of sum over probe keys j of A_h[i, j];

a KV head takes the largest r_h of the query heads that share it (the cache, and so
the choice, is per KV head). Probes (tokenmill/calibrate.py): `needle` (the default),
long-context task items with their answer appended, queries the positions that
predict the answer, keys the line holding the fact asked for; or `random`,
[lead][X][filler][X] of random ids, queries the second copy of X (its first token
aside), keys the first (the lead keeps attention sinks out). On pycoder-long the two
pick disjoint heads, and only the needle's keep dense accuracy on the lookup tasks
(docs/BENCHMARKS.md): a head that copies random text is not the head that finds a
fact.

Index: the cache holds keys after RoPE, and a fixed projection applied after RoPE
would break relative position; a subset of whole rotary pairs does not (each pair's
share of q . k depends on the two positions' difference only). Per KV head the
calibration keeps the index_dims / 2 pairs with the largest mean |q_pair| * |k_pair|
(pre-RoPE, measured on the same sequences; the query side averaged over the heads of
the group): the pairs whose share of the score can be largest, whatever the rotation.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

FILENAME = "sparse_calibration.json"
FORMAT = 1


@dataclass(frozen=True)
class SparseCalibration:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    index_dims: int
    retrieval_score: list[list[float]]  # [layer][KV head]
    index_pairs: list[list[list[int]]]  # [layer][KV head] -> rotary pair numbers
    method: dict  # how it was measured: seed, sequences, length, ...

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"format": FORMAT, **asdict(self)}, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> SparseCalibration:
        data = json.loads(Path(path).read_text())
        if data.pop("format", None) != FORMAT:
            raise ValueError(f"sparse_calibration: {path} is not a format-{FORMAT} "
                             "calibration; rerun `tokenmill calibrate sparse`")
        return cls(**data)

    def check(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        found = (self.num_layers, self.num_kv_heads, self.head_dim)
        if found != (num_layers, num_kv_heads, head_dim):
            raise ValueError(
                f"sparse_calibration: calibrated for (layers, KV heads, head dim) {found}, "
                f"the model has {(num_layers, num_kv_heads, head_dim)}")

    def index_dims_of(self, layer: int, kv_head: int) -> list[int]:
        """The key dimensions of a head's index: each pair m is dims m and m + Dh / 2
        (the rotate-half layout of Llama-family RoPE)."""
        half = self.head_dim // 2
        pairs = self.index_pairs[layer][kv_head]
        return list(pairs) + [m + half for m in pairs]

    def retrieval_heads(self, dense_layers: int, fraction: float) -> list[list[int]]:
        """Per layer, the KV heads that retrieve: the ceil(fraction x count) best-scored
        KV heads of the sparse layers (layers >= dense_layers), at least one."""
        ranked = sorted(((score, layer, head)
                         for layer, scores in enumerate(self.retrieval_score)
                         if layer >= dense_layers
                         for head, score in enumerate(scores)), reverse=True)
        take = max(1, math.ceil(fraction * len(ranked))) if ranked else 0
        chosen: list[list[int]] = [[] for _ in range(self.num_layers)]
        for _, layer, head in ranked[:take]:
            chosen[layer].append(head)
        return [sorted(heads) for heads in chosen]


def attention_mass(attention: torch.Tensor, queries: list[int], keys: list[int]
                   ) -> torch.Tensor:
    """attention [H, L, L] (rows are queries) -> [H]: the mean over the query
    positions of their attention to the key positions."""
    rows = attention[:, queries][:, :, keys]
    return rows.sum(-1).mean(-1)


def copy_attention_mass(attention: torch.Tensor, first: range, second: range) -> torch.Tensor:
    """attention [H, L, L] -> [H]: the mean over queries of the second copy, its first
    token aside, of their attention to the first copy."""
    return attention_mass(attention, list(second)[1:], list(first))


def pair_strength(q: torch.Tensor, k: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Pre-RoPE q [N, H, Dh] and k [N, KVH, Dh] -> [KVH, Dh / 2]: the mean |q_pair|
    (over positions and the group's query heads) times the mean |k_pair|."""
    half = q.shape[-1] // 2
    q_norm = torch.hypot(q[..., :half], q[..., half:]).mean(0)  # [H, half]
    k_norm = torch.hypot(k[..., :half], k[..., half:]).mean(0)  # [KVH, half]
    group = q.shape[1] // num_kv_heads
    return q_norm.view(num_kv_heads, group, half).mean(1) * k_norm


def strongest_pairs(strength: torch.Tensor, index_dims: int) -> list[list[int]]:
    """Per KV head the index_dims / 2 strongest pairs, in pair order (ties: lower pair)."""
    count = max(1, min(index_dims // 2, strength.shape[-1]))
    return [sorted(torch.argsort(-row, stable=True)[:count].tolist()) for row in strength]
