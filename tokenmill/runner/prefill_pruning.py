"""LazyLLM-style prefill pruning (`--prefill-pruning KEEP`, experimental).

LazyLLM (Fu et al., 2024) computes, in a long prompt's prefill, only the tokens the
last position needs: after a layer, the prompt tokens the last token attends to least
are left out of the layers above. Here, in one stage and in whole KV blocks:

- A prompt is pruned when its whole prompt is prefilled in one step (a chunked prompt
  is not: its last chunk cannot revisit the earlier ones) and it has at least
  `min_tokens` tokens.
- Before layer `layer`, the last prompt token's attention at layer `layer - 1` (its
  query on the prompt's keys, recomputed from that layer's input; mean over heads)
  is summed per block. The first block (attention sinks), the last block (the last
  token's own) and the best-scored blocks up to ceil(keep x blocks) are kept; the
  other blocks are dropped.
- Layers `layer` and up run on the kept tokens only (that is the saving: fewer rows
  through the projections, the MLPs and attention), and never hold the dropped
  tokens' K/V: every later step of the request attends there through a block table
  without the dropped blocks (whole blocks, so each kept token keeps its slot and the
  positions baked into its rotated key). Layers below `layer` keep the whole prompt.
- The "computed later if needed" half of LazyLLM (its auxiliary cache that revives
  pruned tokens) is not built: dropped is dropped. A dropped prompt position's hidden
  state (what prompt logprobs would read) is its input to layer `layer`.

Prefix caching, speculative decoding, early exit, the sparse backends and parallelism
are refused with it (config): a cached block's upper layers would lack the dropped
tokens, and the others bring their own per-layer rows.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from tokenmill.attention.base import AttentionContext, BatchLayout
from tokenmill.core.step import ScheduledRequest
from tokenmill.layers.rotary import apply_rotary

logger = logging.getLogger(__name__)


@dataclass
class PrefillPruning:
    layer: int  # layers >= layer see only the kept blocks
    keep: float  # share of a pruned prompt's blocks kept there
    min_tokens: int  # shorter prompts are not pruned
    # Request id -> its dropped logical blocks (sorted), while the request runs.
    dropped: dict[str, list[int]] = field(default_factory=dict)
    prompts: int = 0  # prompts pruned
    prompt_tokens: int = 0  # their tokens
    dropped_tokens: int = 0  # of those, left out of the upper layers
    warned_chunked: bool = False  # a chunked prompt (not pruned) was logged

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.dropped.pop(request_id, None)

    def plan(self, requests: list[ScheduledRequest], block_size: int
             ) -> tuple[list[int], bool]:
        """For a step's requests in batch order: the slots of whole prompts to prune,
        and whether any request runs with dropped blocks (from this step or before)."""
        prune = []
        for slot, request in enumerate(requests):
            if request.num_computed_tokens == 0:  # a prompt (again, after a preemption)
                self.dropped.pop(request.request_id, None)
                if (request.sampling is not None and request.num_spec_tokens == 0
                        and request.num_new_tokens >= max(self.min_tokens, 2 * block_size)):
                    prune.append(slot)
            elif (not request.is_decode and request.sampling is not None
                  and request.num_computed_tokens + request.num_new_tokens >= self.min_tokens
                  and not self.warned_chunked):
                # The last chunk of a chunked prompt: too late to prune it.
                self.warned_chunked = True
                logger.warning("prefill pruning: a prompt was prefilled in chunks and is "
                               "not pruned (pruning needs the whole prompt in one step: "
                               "raise --max-num-batched-tokens above the prompt length)")
        return prune, bool(prune) or any(r.request_id in self.dropped for r in requests)


def kept_blocks(mass: torch.Tensor, keep: float) -> list[int]:
    """mass [blocks] -> the kept block numbers, sorted: the first, the last and the
    best-scored others, ceil(keep x blocks) in all (at least those two)."""
    count = mass.numel()
    want = max(min(count, 2), math.ceil(keep * count))
    forced = {0, count - 1}
    ranked = [b for b in torch.argsort(mass, descending=True, stable=True).tolist()
              if b not in forced]
    return sorted(forced | set(ranked[:want - len(forced)]))


def compact(table: list[int], dropped: list[int]) -> list[int]:
    """A block table without the dropped logical blocks."""
    gone = set(dropped)
    return [block for logical, block in enumerate(table) if logical not in gone]


def late_layout(layout: BatchLayout, ids: list[str], pruning: PrefillPruning,
                rows: torch.Tensor | None = None) -> BatchLayout:
    """What layers >= pruning.layer see: each request's table without its dropped
    blocks, its cached context less them; `rows`: the batch rows still computed (all
    when None) with each request's query range shrunk to its kept rows."""
    tables, contexts = [], []
    for request_id, table, context in zip(ids, layout.block_tables, layout.context_lens,
                                          strict=True):
        dropped = pruning.dropped.get(request_id, [])
        tables.append(compact(table, dropped))
        cached = sum(1 for b in dropped if b * layout.block_size < context)
        contexts.append(context - cached * layout.block_size)
    query_start, slots = layout.query_start, layout.slot_mapping
    if rows is not None:
        starts = torch.tensor(layout.query_start, device=rows.device)
        query_start = torch.searchsorted(rows, starts).tolist()
        slots = slots[rows]
    return BatchLayout(query_start, contexts, tables, layout.num_decode_requests, slots,
                       layout.block_size)


def prompt_block_mass(layer: torch.nn.Module, hidden_in: torch.Tensor,
                      rope: tuple[torch.Tensor, torch.Tensor], block_size: int
                      ) -> torch.Tensor:
    """hidden_in [n, hidden]: one prompt's input to `layer` -> [blocks]: the last
    token's attention at that layer, mean over heads, summed per block."""
    attn = layer.self_attn
    n = hidden_in.shape[0]
    qkv = attn.qkv_proj(layer.input_layernorm(hidden_in))
    q = qkv[-1:, :attn.q_size].view(1, attn.num_heads, attn.head_dim)
    k = qkv[:, attn.q_size:attn.q_size + attn.kv_size].view(n, attn.num_kv_heads,
                                                             attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = apply_rotary(q, (rope[0][-1:], rope[1][-1:]))[0]  # [H, D]
    k = apply_rotary(k, rope).repeat_interleave(attn.num_heads // attn.num_kv_heads, 1)
    scores = torch.einsum("hd,nhd->hn", q.float(), k.float()) * attn.scale
    token_mass = scores.softmax(-1).mean(0)  # [n]
    blocks = -(-n // block_size)
    padded = torch.zeros(blocks * block_size, device=token_mass.device)
    padded[:n] = token_mass
    return padded.view(blocks, block_size).sum(-1)


def forward_with_pruning(model: torch.nn.Module, token_ids: torch.Tensor,
                         positions: torch.Tensor, attention: AttentionContext,
                         layout: BatchLayout, ids: list[str], candidates: list[int],
                         pruning: PrefillPruning) -> torch.Tensor:
    """Final hidden states [T, hidden]; `candidates`: the batch slots of whole prompts
    to prune this step (their drops are recorded in `pruning`)."""
    inner = model.model
    hidden = model.embed(token_ids)
    rope = inner.rotary(positions, hidden.dtype)
    starts = layout.query_start
    below = None
    for index, layer in enumerate(inner.layers):
        if index == pruning.layer - 1 and candidates:
            below = hidden
        if index == pruning.layer:
            rows = None
            if candidates:
                keep_rows = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
                for slot in candidates:
                    a, b = starts[slot], starts[slot + 1]
                    mass = prompt_block_mass(inner.layers[index - 1], below[a:b],
                                             (rope[0][a:b], rope[1][a:b]), layout.block_size)
                    kept = kept_blocks(mass, pruning.keep)
                    dropped = sorted(set(range(mass.numel())) - set(kept))
                    pruning.dropped[ids[slot]] = dropped
                    for block in dropped:
                        keep_rows[a + block * layout.block_size:
                                  a + (block + 1) * layout.block_size] = False
                    pruning.prompts += 1
                    pruning.prompt_tokens += b - a
                    pruning.dropped_tokens += len(dropped) * layout.block_size
                rows = keep_rows.nonzero().squeeze(1)
                full = hidden
                hidden = hidden[rows]
                rope = (rope[0][rows], rope[1][rows])
            late = late_layout(layout, ids, pruning, rows)
            attention = AttentionContext(attention.backend,
                                         attention.backend.build_metadata(late),
                                         attention.kv_caches)
        hidden = layer(rope, hidden, attention)
    hidden = inner.norm(hidden)
    if candidates:  # dropped rows: their input to the pruning layer, normed
        out = inner.norm(full)
        out[rows] = hidden
        return out
    return hidden
