"""ParallelConfig: where the model runs and how its ranks share the work (one part of
EngineConfig, tokenmill/config/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tokenmill.config.validate import require as _require

EXECUTORS = ("auto", "in-process", "multiprocess")
ALL_REDUCE = ("backend", "ring", "tree", "rhd")
EXPERT_ROUTING = ("round_robin", "least_loaded", "locality")


@dataclass(frozen=True)
class ParallelConfig:
    """Where the model runs: in the engine's process, or in worker processes that
    receive each step as plain data; how many ranks share it and how they sum."""

    # auto: in-process for one rank, worker processes for several.
    executor: Literal["auto", "in-process", "multiprocess"] = "auto"
    # Ranks the model's layers are split over (Megatron tensor parallelism), one worker
    # process each (gloo on the CPU, NCCL on CUDA).
    tensor_parallel_size: int = 1
    # Who sums the row-parallel partial products: torch.distributed's own all-reduce,
    # or tokenmill's ring, tree or recursive halving-doubling (tokenmill/dist).
    all_reduce: Literal["backend", "ring", "tree", "rhd"] = "backend"
    # Megatron SP under TP: reduce-scatter + all-gather instead of each all-reduce;
    # norms and residual adds on 1/TP of the tokens.
    sequence_parallel: bool = False
    # Stages of consecutive layers, each of tensor_parallel_size ranks.
    pipeline_parallel_size: int = 1
    # Micro-batches a step is cut into so that stages overlap (None: one per stage).
    pipeline_micro_batches: int | None = None
    # MoE models under TP: each rank holds E / TP whole experts instead of a shard of
    # every expert; with --sequence-parallel tokens reach them by all-to-all.
    expert_parallel: bool = False
    # MoE models: the window expert-load statistics (imbalance in /metrics) cover.
    expert_stats_window_s: float = 10.0
    # Expert parallelism with hot-expert replication (EPLB-style, dist/eplb.py): this
    # many extra expert copies over all ranks, (E + slots) / TP experts per rank.
    expert_redundant_slots: int = 0
    # Which copy of a replicated expert a token goes to (dist/eplb.py).
    expert_routing: Literal["round_robin", "least_loaded", "locality"] = "least_loaded"
    # With replicas: every this many seconds (0: every step; inf: never) the copies
    # are re-planned from the last window's expert load, moving the weights of those
    # that change between ranks, and the routers' load estimate is refreshed.
    expert_balance_window_s: float = 0.1
    # A re-plan moves weights only if it cuts the busiest rank's planned load by at
    # least this fraction (otherwise only the load estimate is refreshed).
    expert_replan_min_gain: float = 0.05

    def __post_init__(self) -> None:
        _require(self.executor in EXECUTORS, "executor", f"one of {EXECUTORS}", self.executor)
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            _require(isinstance(value, int) and 1 <= value <= 64, name, "an integer in [1, 64]",
                     value)
        _require(self.all_reduce in ALL_REDUCE, "all_reduce", f"one of {ALL_REDUCE}",
                 self.all_reduce)
        _require(self.pipeline_micro_batches is None
                 or (isinstance(self.pipeline_micro_batches, int)
                     and 1 <= self.pipeline_micro_batches <= 64), "pipeline_micro_batches",
                 "None or an integer in [1, 64]", self.pipeline_micro_batches)
        for name in ("sequence_parallel", "expert_parallel"):  # they split TP's ranks' work
            _require(not getattr(self, name) or self.tensor_parallel_size > 1, name,
                     "off when tensor_parallel_size is 1", getattr(self, name))
        _require(isinstance(self.expert_stats_window_s, (int, float))
                 and self.expert_stats_window_s >= 0, "expert_stats_window_s",
                 "a number of seconds >= 0", self.expert_stats_window_s)
        _require(self.expert_routing in EXPERT_ROUTING, "expert_routing",
                 f"one of {EXPERT_ROUTING}", self.expert_routing)
        _require(isinstance(self.expert_balance_window_s, (int, float))
                 and self.expert_balance_window_s >= 0, "expert_balance_window_s",
                 "a number of seconds >= 0 (inf: never re-plan)", self.expert_balance_window_s)
        _require(isinstance(self.expert_replan_min_gain, (int, float))
                 and 0 <= self.expert_replan_min_gain < 1, "expert_replan_min_gain",
                 "a fraction in [0, 1)", self.expert_replan_min_gain)
        _require(isinstance(self.expert_redundant_slots, int)
                 and (self.expert_redundant_slots == 0 or self.expert_parallel
                      and self.expert_redundant_slots > 0 and self.pipeline_parallel_size == 1),
                 "expert_redundant_slots", "0, or > 0 with expert_parallel and "
                 "pipeline_parallel_size 1", self.expert_redundant_slots)
        _require(self.executor != "in-process" or self.world_size == 1, "executor",
                 "'multiprocess' or 'auto' when tensor_parallel_size or "
                 "pipeline_parallel_size > 1", self.executor)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def micro_batches(self) -> int:
        return self.pipeline_micro_batches or self.pipeline_parallel_size
