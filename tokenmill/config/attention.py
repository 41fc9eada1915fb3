"""AttentionConfig: which attention backend runs the model's attention layers and the
sparse backends' knobs (one part of EngineConfig, tokenmill/config/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.config.validate import require as _require

SPARSE_BACKENDS = ("quest", "static-topk", "retrieval-topp")


@dataclass(frozen=True)
class AttentionConfig:
    """Which attention backend runs the model's attention layers."""

    # A name registered in tokenmill/attention/registry.py (checked when the worker
    # builds it: backends can be registered at run time).
    attention_backend: str = field(
        default="paged-native",
        metadata={"registry": "tokenmill.attention.registry:ATTENTION_BACKENDS"})
    # Sparse backends (quest, static-topk): tokens of context each decode query attends
    # to, in whole blocks (the first block and the query's own always among them); a
    # request whose context fits attends densely. retrieval-topp: the most tokens a
    # retrieval head keeps (its ceiling).
    sparse_budget: int = 1024
    # Sparse backends: leading layers kept dense (Quest keeps layers 0 and 1 dense).
    sparse_dense_layers: int = 2
    # retrieval-topp: blocks are kept in order of their index mass until it reaches p.
    sparse_top_p: float = 0.9
    # retrieval-topp: the fewest tokens a retrieval head keeps (its floor).
    sparse_min_tokens: int = 64
    # retrieval-topp: every head attends to the first sink tokens and the last window
    # tokens (local heads to nothing else).
    sparse_sink_tokens: int = 32
    sparse_window: int = 256
    # retrieval-topp: share of the sparse layers' KV heads that retrieve (the best by
    # calibrated score, at least one).
    sparse_retrieval_fraction: float = 0.15
    # retrieval-topp: the calibration file (default: sparse_calibration.json in the
    # model directory, written by `tokenmill calibrate sparse`).
    sparse_calibration: str | None = None
    # Sparse backends: decode rows with a shorter context run dense attention. None:
    # the crossover measured on this machine at start-up (cached); 0: always sparse.
    sparse_min_context: int | None = None
    # Sparse backends: prefill chunks whose cached context is over twice what the
    # rule keeps at least attend to the blocks the decode rule keeps for a few of their
    # queries, and to themselves (attention/sparse_prefill.py). Off: prefill is dense.
    sparse_prefill: bool = False
    # Prefill pruning (LazyLLM-style, experimental; runner/prefill_pruning.py): the
    # share of a long prompt's KV blocks that layers >= prefill_pruning_layer compute
    # and keep, chosen by the last prompt token's attention (None: off).
    prefill_pruning: float | None = None
    # The first layer that sees only the kept blocks (None: a third of the layers).
    prefill_pruning_layer: int | None = None
    # Prompts shorter than this are not pruned.
    prefill_pruning_min_tokens: int = 1024

    def __post_init__(self) -> None:
        _require(isinstance(self.attention_backend, str) and bool(self.attention_backend),
                 "attention_backend", "a registered backend name", self.attention_backend)
        _require(isinstance(self.sparse_budget, int) and self.sparse_budget >= 1,
                 "sparse_budget", "a positive number of tokens", self.sparse_budget)
        _require(isinstance(self.sparse_dense_layers, int) and self.sparse_dense_layers >= 0,
                 "sparse_dense_layers", "a number of layers >= 0", self.sparse_dense_layers)
        _require(isinstance(self.sparse_top_p, (int, float)) and 0 < self.sparse_top_p <= 1,
                 "sparse_top_p", "in (0, 1]", self.sparse_top_p)
        for name in ("sparse_min_tokens", "sparse_sink_tokens", "sparse_window"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= (1 if name == "sparse_window" else 0),
                     name, "a number of tokens (the window at least 1)", value)
        _require(isinstance(self.sparse_retrieval_fraction, (int, float))
                 and 0 < self.sparse_retrieval_fraction <= 1, "sparse_retrieval_fraction",
                 "in (0, 1]", self.sparse_retrieval_fraction)
        _require(self.sparse_min_context is None
                 or (isinstance(self.sparse_min_context, int) and self.sparse_min_context >= 0),
                 "sparse_min_context", "None (measured) or a number of tokens >= 0",
                 self.sparse_min_context)
        _require(isinstance(self.sparse_prefill, bool), "sparse_prefill", "True or False",
                 self.sparse_prefill)
        _require(self.prefill_pruning is None
                 or (isinstance(self.prefill_pruning, (int, float))
                     and not isinstance(self.prefill_pruning, bool)
                     and 0 < self.prefill_pruning <= 1),
                 "prefill_pruning", "None (off) or a share of blocks in (0, 1]",
                 self.prefill_pruning)
        _require(self.prefill_pruning_layer is None
                 or (isinstance(self.prefill_pruning_layer, int)
                     and not isinstance(self.prefill_pruning_layer, bool)
                     and self.prefill_pruning_layer >= 1),
                 "prefill_pruning_layer", "None or a layer >= 1", self.prefill_pruning_layer)
        _require(isinstance(self.prefill_pruning_min_tokens, int)
                 and not isinstance(self.prefill_pruning_min_tokens, bool)
                 and self.prefill_pruning_min_tokens >= 1, "prefill_pruning_min_tokens",
                 "a number of tokens >= 1", self.prefill_pruning_min_tokens)
