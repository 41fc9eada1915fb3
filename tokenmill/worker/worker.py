"""The Worker: everything on the device side of the executor boundary.

It loads the model with the kernels the product policy picks (layers/products.py),
plans the KV pool (the speculative proposer's pool included) and allocates it, builds
the proposer, and then runs what the engine sends as plain data: a step
(`execute`), a round of proposals (`propose`), the release of finished requests.
It holds no engine object; an executor may run it in the engine's process or in a
child process.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.attention.base import SparseSettings
from tokenmill.config import EngineConfig
from tokenmill.core.step import ProposalRequest, StepInput, StepOutput
from tokenmill.dist.context import (
    GroupCollectives,
    Rendezvous,
    init_group,
    min_over_ranks,
    stage_group,
)
from tokenmill.dist.expert_replicas import ReplicaSet
from tokenmill.dist.pipeline import PipelineSends, PipelineStage, micro_batches
from tokenmill.dist.tensor_parallel import tensor_parallel_selector
from tokenmill.layers import allocator, huge_pages
from tokenmill.layers.linear import weight_bytes
from tokenmill.layers.moe import SparseMoE
from tokenmill.layers.parallel import SINGLE_RANK, Collectives
from tokenmill.layers.products import product_policy
from tokenmill.layers.row_slices import set_mlp_slice_rows
from tokenmill.model.arch import ArchConfig
from tokenmill.model.loader import load_model, read_config, resolve_device, resolve_dtype
from tokenmill.runner.early_exit import EarlyExit
from tokenmill.runner.model_runner import ModelRunner, PreparedBatch
from tokenmill.runner.prefill_pruning import PrefillPruning
from tokenmill.runner.sampling import StepSampler
from tokenmill.speculative.factory import build_proposer, proposer_context, proposer_footprint
from tokenmill.worker.calibration import calibrate
from tokenmill.worker.memory import KVPlan, plan_kv_blocks, target_products

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryUsage:
    """Bytes the worker allocated at start-up, as measured on its tensors."""

    weights: int  # the target's parameters in every form kept (packed copies included)
    kv_cache: int
    proposer_weights: int = 0
    proposer_kv_cache: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.proposer_weights + self.proposer_kv_cache


def resolve_max_model_len(config: EngineConfig, arch: ArchConfig) -> int:
    max_model_len = config.model.max_model_len or arch.max_position_embeddings
    if arch.sliding_window is not None and arch.sliding_window < max_model_len:
        # Attention is exact full attention; within the window that equals the
        # sliding-window model, so the context is capped there.
        logger.warning("capping max_model_len at the model's sliding window %d",
                       arch.sliding_window)
        max_model_len = arch.sliding_window
    return max_model_len


class Worker:
    def __init__(self, config: EngineConfig, progress: bool = True,
                 rendezvous: Rendezvous | None = None) -> None:
        """rendezvous: this worker's rank among the tensor-parallel ranks (None: the only
        one, unless torchrun's environment says otherwise)."""
        mcfg = config.model
        device = resolve_device(mcfg.device)
        self.group, self.stage = self._join_group(config, device, rendezvous)
        self.sends = PipelineSends(self.stage) if self.stage is not None else None
        # Ranks share the machine's cores (torch's default: all of them, per process).
        threads = mcfg.num_threads or max(1, torch.get_num_threads() // self.group.size)
        torch.set_num_threads(threads)
        torch.manual_seed(mcfg.seed)
        if mcfg.retain_freed_memory:
            allocator.retain_freed_memory()
        dtype = resolve_dtype(mcfg.dtype, device)
        # Proposers keep the base products: weight quantization applies to the target.
        self.base_products = product_policy(mcfg.cpu_blas, device, dtype)
        self.products = target_products(config, self.base_products, dtype, self.stage)
        self.products.configure_threads(threads)
        self.replicas = self._replica_set(config)
        with huge_pages.for_weights(mcfg.huge_pages, arena=mcfg.weight_arena):
            loaded = load_model(mcfg.model, mcfg.dtype, mcfg.device, mcfg.max_model_len,
                                progress=progress and self.group.rank == 0, group=self.group,
                                select_linear=tensor_parallel_selector(
                                    self.products.selector, self.group),
                                stage=self.stage, expert_slots=self.replicas and
                                self.replicas.initial_slots)
        calibrate(loaded.model, config)  # activation-aware quantization, when configured
        self.mlp_slices = set_mlp_slice_rows(loaded.model, mcfg.mlp_slice_rows,
                                             loaded.dtype.itemsize, loaded.device)
        self.arch, self.device, self.dtype = loaded.arch, loaded.device, loaded.dtype
        self.generation_config = loaded.generation_config
        self.max_model_len = resolve_max_model_len(config, loaded.arch)
        self.config = config = config.with_max_model_len(self.max_model_len)
        context = proposer_context(config, loaded.arch, loaded.device, loaded.dtype)
        # A rank's KV pool holds its own KV heads: its geometry sizes the blocks.
        self.kv_plan: KVPlan = plan_kv_blocks(config, loaded.local_arch, loaded.dtype,
                                              loaded.device, proposer_footprint(context))
        if self.stage is not None:
            # Stages hold different layers, but one scheduler hands out the blocks.
            self.kv_plan = dataclasses.replace(
                self.kv_plan, num_blocks=min_over_ranks(self.kv_plan.num_blocks, device))
        self.runner = ModelRunner(loaded.model, loaded.local_arch, self.kv_plan.num_blocks,
                                  config.cache.block_size, loaded.device, loaded.dtype,
                                  config.cache.kv_cache_dtype,
                                  config.attention.attention_backend,
                                  early_exit(config), sparse_settings(config),
                                  prefill_pruning(config, loaded.arch.num_layers))
        self.sampler = StepSampler(loaded.model, seed=mcfg.seed)
        if context is not None:
            context.target, context.num_blocks = loaded, self.kv_plan.num_blocks
            context.select_linear, context.progress = self.base_products.selector, progress
        # A draft model's weights too.
        with huge_pages.for_weights(mcfg.huge_pages, arena=mcfg.weight_arena):
            self.proposer = build_proposer(context)
        # Distributions the last proposals' sampled drafts were drawn from, by request.
        self._draft_probs: dict[str, torch.Tensor] = {}
        self.memory = self._measure_memory()
        self._moe_layers = [m for m in loaded.model.modules() if isinstance(m, SparseMoE)]
        for moe in self._moe_layers:  # built on the meta device: the counts are garbage
            moe.expert_load.zero_()
        if self.replicas is not None:
            self.replicas.attach(self._moe_layers)
        # Seconds this step waited on the previous pipeline stage or its own sends.
        self._pipeline_seconds = 0.0
        # Optional step tracer (tokenmill.profile.StepTracer); None costs nothing.
        self.tracer = None
        self._log_start_up()

    @staticmethod
    def _join_group(config: EngineConfig, device: torch.device, rendezvous: Rendezvous | None
                    ) -> tuple[Collectives, PipelineStage | None]:
        """This rank's tensor-parallel group and pipeline stage (ranks stage-major)."""
        parallel = config.parallel
        backend = "nccl" if device.type == "cuda" else "gloo"
        rendezvous = rendezvous or Rendezvous.from_environment(backend)
        if rendezvous is None or parallel.world_size == 1:
            return SINGLE_RANK, None
        if rendezvous.world_size != parallel.world_size:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size is "
                             f"{parallel.world_size} but the rendezvous has "
                             f"{rendezvous.world_size} ranks")
        init_group(rendezvous)
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        stage_index, tp_rank = divmod(rendezvous.rank, tp)
        group: Collectives = SINGLE_RANK
        if tp > 1:
            group = GroupCollectives(tp_rank, tp, parallel.all_reduce,
                                     group=stage_group(stage_index, tp, pp),
                                     sequence_parallel=parallel.sequence_parallel,
                                     expert_parallel=parallel.expert_parallel)
        if pp == 1:
            return group, None
        num_layers = read_config(config.model.model).num_layers
        return group, PipelineStage.of(stage_index, pp, num_layers, tp, tp_rank)

    def _replica_set(self, config: EngineConfig) -> ReplicaSet | None:
        """Replicas of hot experts (--expert-redundant-slots), None without."""
        parallel = config.parallel
        if not parallel.expert_redundant_slots:
            return None
        experts = read_config(config.model.model).num_experts
        return ReplicaSet(experts, self.group, parallel.expert_redundant_slots,
                          parallel.expert_routing, parallel.expert_replan_min_gain)

    def _measure_memory(self) -> MemoryUsage:
        proposer = self.proposer.memory_bytes() if self.proposer is not None else (0, 0)
        return MemoryUsage(weight_bytes(self.runner.model), self.runner.kv_cache_bytes(),
                           *proposer)

    def _log_start_up(self) -> None:
        plan = self.kv_plan
        logger.info("KV cache (%s): %d blocks of %d tokens (%.1f MiB), %d tokens, "
                    "%d concurrent sequences at %d tokens; weights %.1f MiB; products: %s; "
                    "MLP slices: %s rows",
                    plan.kv_cache_dtype, plan.num_blocks, plan.block_size,
                    plan.total_bytes / 2**20, plan.num_tokens, plan.max_concurrent_sequences,
                    self.max_model_len, self.memory.weights / 2**20, self.products.name,
                    "/".join(map(str, self.mlp_slices)) or "none")

    # ---- what the engine asks for -----------------------------------------------------
    def set_tracer(self, tracer) -> None:
        self.tracer = self.sampler.tracer = tracer

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        clock = PhaseClock(self.tracer)
        moves = 0
        with self.products.step_context():
            if self.runner.pruning is not None:
                self.runner.pruning.release(step.preempted_request_ids)
            for request_id in step.preempted_request_ids:
                self._draft_probs.pop(request_id, None)
                if self.proposer is not None:
                    self.proposer.release(request_id)
            if step.rebalance_experts and self.replicas is not None:
                moves = self.replicas.rebalance()  # every rank on this step: weights move
                clock.mark("expert_rebalance")
            batch = self.runner.prepare(step.requests)
            clock.mark("prepare_inputs")
            if self.stage is None:
                hidden = self.runner.forward(batch)
            else:
                hidden = self._forward_stage(step, batch)
                if hidden is None:  # not the last stage: the last one samples and answers
                    return StepOutput(expert_load=self._take_expert_load())
            clock.mark("forward")
            output = self.sampler.run(step.requests, batch, hidden, self._draft_probs)
            if step.keep_hidden_states and self.proposer is not None:
                self._observe(step, batch.order, batch.query_start, hidden, output)
            clock.mark("sample")
        output.phase_seconds = clock.seconds
        output.expert_load = self._take_expert_load()
        take_counts = getattr(self.runner.backend, "take_counts", None)
        if take_counts is not None:
            output.sparse_attention = take_counts()
        if self.replicas is not None:
            output.rank_load = self.replicas.take_rank_load()
            output.expert_moves = moves
        communication = self._pipeline_seconds
        if isinstance(self.group, GroupCollectives):
            communication += self.group.take_comm_seconds()
        if self.group.size > 1 or self.stage is not None:
            output.phase_seconds["communication"] = communication
        return output

    def _take_expert_load(self) -> list[list[int]]:
        """Tokens per expert of each MoE layer since the last call (then zeroed)."""
        if not self._moe_layers:
            return []
        counts = torch.stack([moe.expert_load for moe in self._moe_layers])
        for moe in self._moe_layers:
            moe.expert_load.zero_()
        if self._moe_layers[0].all_to_all:  # each rank routed its own share of the tokens
            self.group.all_reduce(counts)
        loads = counts.tolist()
        if self.replicas is not None:
            self.replicas.record(loads)
        return loads

    def _forward_stage(self, step: StepInput, batch: PreparedBatch) -> torch.Tensor | None:
        """This stage's part of the forward, micro-batch by micro-batch: the hidden
        states of the whole batch on the last stage, None on the others."""
        stage, sends = self.stage, self.sends
        tokens = [len(step.requests[i].token_ids) for i in batch.order]
        runs = micro_batches(tokens, self.config.parallel.micro_batches)
        outputs = []
        for run in runs:
            # A run of the batch's order is prepared in that order (decodes lead).
            part = batch if len(runs) == 1 else self.runner.prepare(
                [step.requests[batch.order[j]] for j in run])
            hidden = None
            if not stage.first:
                hidden = sends.receive(len(part.token_ids), self.arch.hidden_size,
                                       self.dtype, self.device)
            hidden = self.runner.forward(part, hidden)
            if stage.last:
                outputs.append(hidden)
            else:
                sends.send(hidden)
        self._pipeline_seconds = sends.finish()
        return torch.cat(outputs) if stage.last else None

    def _observe(self, step: StepInput, order: list[int], query_start: list[int],
                 hidden: torch.Tensor, output: StepOutput) -> None:
        """Hand the proposer the hidden states of the positions now verified."""
        for slot, index in enumerate(order):
            request = step.requests[index]
            verified = (len(output.outputs[request.request_id].token_ids)
                        if request.num_spec_tokens else request.num_new_tokens)
            start = query_start[slot]
            self.proposer.observe(request.request_id, request.num_computed_tokens,
                                  hidden[start:start + verified])

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """Draft tokens per request (the distributions stay here, for verification)."""
        with self.products.step_context():
            proposals = self.proposer.propose(requests)
        self._draft_probs = {r.request_id: p.probs for r, p in
                             zip(requests, proposals, strict=True) if p.probs is not None}
        return [p.token_ids for p in proposals]

    def release(self, request_ids: list[str]) -> None:
        """These requests finished: drop their proposer state and pending drafts."""
        if self.runner.pruning is not None:
            self.runner.pruning.release(request_ids)
        for request_id in request_ids:
            self._draft_probs.pop(request_id, None)
            if self.proposer is not None:
                self.proposer.release(request_id)

    def check_integrity(self, idle: bool = False) -> None:
        """The proposer's cache structures; idle: nothing may hold state any more."""
        if self.proposer is not None:
            self.proposer.check_integrity(idle)
        if idle:
            assert not self._draft_probs, "draft distributions of finished requests"
            assert self.runner.pruning is None or not self.runner.pruning.dropped, \
                "dropped prefill blocks of finished requests"

    @property
    def needs_hidden_states(self) -> bool:
        return self.proposer is not None and self.proposer.needs_hidden_states



def sparse_settings(config: EngineConfig) -> SparseSettings:
    """The sparse backends' knobs; the calibration defaults to the model's own file."""
    attention = config.attention
    calibration = attention.sparse_calibration
    if calibration is None:
        model = Path(config.model.model)
        calibration = str((model if model.is_dir() else model.parent)
                          / "sparse_calibration.json")
    return SparseSettings(attention.sparse_budget, attention.sparse_dense_layers,
                          attention.sparse_top_p, attention.sparse_min_tokens,
                          attention.sparse_sink_tokens, attention.sparse_window,
                          attention.sparse_retrieval_fraction, calibration,
                          attention.sparse_min_context, attention.sparse_prefill)


def prefill_pruning(config: EngineConfig, num_layers: int) -> PrefillPruning | None:
    attention = config.attention
    if attention.prefill_pruning is None:
        return None
    layer = attention.prefill_pruning_layer
    return PrefillPruning(max(1, num_layers // 3) if layer is None else layer,
                          attention.prefill_pruning, attention.prefill_pruning_min_tokens)


def early_exit(config: EngineConfig) -> EarlyExit | None:
    layer = config.model.early_exit_layer
    return None if layer is None else EarlyExit(layer, config.model.early_exit_threshold)


class PhaseClock:
    """Times a step's phases for StepOutput.phase_seconds, and marks them on a tracer
    attached in this process (None: nothing to mark)."""

    def __init__(self, tracer) -> None:
        self.tracer = tracer
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if self.tracer is not None:
            self.tracer.mark(phase)
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

