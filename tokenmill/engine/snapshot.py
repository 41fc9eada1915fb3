"""The engine counters an AsyncLLMEngine's loop thread publishes for metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineSnapshot:
    """Engine counters published by the loop thread for metrics (read without locks)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_aborted_requests: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    spec_accepted_by_position: tuple[int, ...] = ()
    # Sparse attention: (layer, head kind, keys, queries).
    sparse_attention_by_layer: tuple[tuple[int, str, int, int], ...] = ()
    # MoE models: tokens per expert of each layer since start-up, and each layer's
    # max / mean expert load over the engine's window.
    expert_tokens: tuple[tuple[int, ...], ...] = ()
    expert_imbalance: tuple[float, ...] = ()
    # Replicated experts: the busiest rank's (token, expert) pairs over the mean rank's.
    rank_imbalance: tuple[float, ...] = ()
