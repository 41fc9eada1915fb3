"""Attention backends by name (`--attention-backend`). A new backend is a file in this
folder and one entry here; nothing in the runner or the models changes."""

from __future__ import annotations

from tokenmill.attention.base import AttentionBackend, AttentionSpec
from tokenmill.attention.paged import PagedAttention
from tokenmill.attention.paged_native import PagedNativeAttention
from tokenmill.attention.quest import QuestAttention, StaticTopKAttention
from tokenmill.attention.retrieval import RetrievalTopPAttention

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    PagedAttention.name: PagedAttention,
    PagedNativeAttention.name: PagedNativeAttention,
    QuestAttention.name: QuestAttention,
    StaticTopKAttention.name: StaticTopKAttention,
    RetrievalTopPAttention.name: RetrievalTopPAttention,
}


def register_attention_backend(backend: type[AttentionBackend]) -> None:
    registered = ATTENTION_BACKENDS.get(backend.name)
    if registered is not None and registered is not backend:
        raise ValueError(f"an attention backend named {backend.name!r} is already registered")
    ATTENTION_BACKENDS[backend.name] = backend


def create_attention_backend(name: str, spec: AttentionSpec) -> AttentionBackend:
    backend = ATTENTION_BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"attention_backend must be one of {sorted(ATTENTION_BACKENDS)}, "
                         f"got {name!r}")
    return backend(spec)
