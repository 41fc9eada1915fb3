"""The weights a kernel packs in place, laid out in one allocation (`--weight-arena`).

Linux backs memory with a huge page only where a whole aligned 2 MB range lies inside
one mapping that asked for it (layers/huge_pages.py). A weight allocated on its own
sits in a mapping of its own size or in the allocator's heap among small tensors: the
0.5B shape's QKV, o and down projections (3-17 MB each) were 70-78% in huge pages,
the rest in 4 KB pages at their ends and between them, and streamed slower than the
LM head. In one allocation whose start is aligned to 2 MB, every byte but those of
the last 2 MB is in huge pages: the decoder stack of a one-row step 1.03-1.04x faster
(docs/BENCHMARKS.md).

`gather(model)` runs on a freshly materialised model, before the checkpoint is
written: every Linear whose method packs its weight in place (`arena_weight`), but
those under a module that may replace them (`reloads_weights`: a MoE layer's routed
experts, which expert replication moves between ranks, so that a slot would outlive
its weight), gets a parameter that is a slot of one arena (per dtype), the layers in
the model's order, each slot 64-byte aligned. The memory the separate weights had was never written, so
nothing is copied. A slot is marked (`is_slot`): the method packs it in place as it
packs a weight that owns its storage.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers import huge_pages

ALIGN = 64  # bytes: a cache line
BASE_ALIGN = huge_pages.MIN_BYTES  # the arena starts on a huge page's boundary
_SLOT = "_tokenmill_arena_slot"


def is_slot(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is one weight's slot of an arena (its bytes are its own)."""
    return getattr(tensor, _SLOT, False)


def arena(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised flat tensor of at least `nbytes`, starting on a 2 MB boundary
    and advised for huge pages (inside `huge_pages.for_weights(True)`)."""
    size = dtype.itemsize
    whole = torch.empty((nbytes + BASE_ALIGN) // size, dtype=dtype)
    huge_pages.advise(whole)
    skip = (-whole.data_ptr() % BASE_ALIGN) // size
    return whole[skip:skip + -(-nbytes // size)]


def gather(model: nn.Module) -> int:
    """Give every CPU Linear of `model` whose method takes it (`arena_weight`) a weight
    in one arena per dtype, inside `huge_pages.for_weights(..., arena=True)`; the bytes
    laid out so."""
    if not huge_pages.arena_asked():
        return 0
    from tokenmill.layers.linear import Linear  # linear imports the methods, they this

    # Layers whose weights may be replaced later (an expert copy moved between ranks):
    # an arena's slot cannot be freed alone, so they keep allocations of their own.
    replaced = {id(sub) for module in model.modules()
                if getattr(module, "reloads_weights", False) for sub in module.modules()}
    weights: dict[int, nn.Parameter] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, Linear) and id(module) not in replaced
                and isinstance(weight, nn.Parameter)
                and weight.device.type == "cpu" and weight.is_contiguous()
                and module.method.arena_weight(module)):
            weights.setdefault(id(weight), weight)  # a tied weight once
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for weight in weights.values():
        by_dtype.setdefault(weight.dtype, []).append(weight)
    moved: dict[int, nn.Parameter] = {}
    for dtype, group in by_dtype.items():
        step = ALIGN // dtype.itemsize
        spans = [-(-w.numel() // step) * step for w in group]
        flat = arena(sum(spans) * dtype.itemsize, dtype)
        offset = 0
        for weight, span in zip(group, spans, strict=True):
            slot = nn.Parameter(flat[offset:offset + weight.numel()].view(weight.shape),
                                requires_grad=weight.requires_grad)
            setattr(slot, _SLOT, True)
            moved[id(weight)] = slot
            offset += span
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in moved:
                setattr(module, name, moved[id(param)])
    return sum(w.numel() * w.element_size() for w in weights.values())
