"""The synchronous engine: add requests, call step() until they finish.

step() = (speculation: propose) -> schedule -> the executor runs the step on the
worker (one forward over the flattened batch, sampling, verification) -> update
requests (computed tokens, prefix-cache registration, detokenisation, stop checks)
-> free the blocks of finished requests, release their worker-side state.

The engine holds the requests, the scheduler, the KV block manager (all from the
torch-free core), detokenization and the speculation hooks; the model, its KV tensors
and kernels are behind the executor, reached only with plain data.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

from tokenmill.chat import load_tokenizer
from tokenmill.config import EngineConfig
from tokenmill.core.expert_load import ExpertLoad
from tokenmill.core.kv_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler, SchedulerOutput
from tokenmill.core.stats import EngineStats
from tokenmill.core.step import StepInput, StepOutput, build_step
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.output_processor import RequestGroup, check_stop, group_output
from tokenmill.executor.base import WorkerDiedError
from tokenmill.executor.factory import create_executor
from tokenmill.outputs import RequestOutput, TokenLogprob
from tokenmill.reasoning import ReasoningMarkers, declared_markers, thinking_progress
from tokenmill.sampling_params import SamplingParams
from tokenmill.speculative.driver import SpeculativeDriver

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.executor = create_executor(config, progress)
        info = self.info = self.executor.info
        self.arch = info.arch
        self.max_model_len = info.max_model_len
        self.kv_plan = info.kv_plan
        self.config = config = config.with_max_model_len(info.max_model_len)
        self.tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
        self.eos_token_ids = self._eos_ids(info.generation_config)
        self.generation_defaults = info.generation_config
        self.kv_manager = KVCacheManager(info.kv_plan.num_blocks, config.cache.block_size,
                                         config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        # A reasoning model's markers (tokenmill/reasoning.py), None when it does not reason.
        self.reasoning: ReasoningMarkers | None = (
            None if config.model.reasoning_parser == "none"
            else declared_markers(info.generation_config, self.tokenizer.get_vocab()))
        self.inputs = InputProcessor(self.tokenizer, info.arch.vocab_size, info.max_model_len,
                                     info.kv_plan.num_blocks, config.cache.block_size,
                                     self.reasoning)
        self.stats = EngineStats()
        # Tokens per expert of each MoE layer (the workers count them each step).
        self.expert_load = ExpertLoad(config.parallel.expert_stats_window_s)
        # With replicated experts: pairs each rank computed (the balance replicas buy),
        # and when the copies were last re-planned.
        self.rank_load = ExpertLoad(config.parallel.expert_stats_window_s)
        self._balanced_at = time.monotonic()
        self.expert_moves, self.expert_rebalance_s = 0, 0.0
        self.speculation = (SpeculativeDriver(config.spec, self.executor.propose,
                                              info.max_model_len, self.stats, info.padded)
                            if info.has_proposer else None)
        self.groups: dict[str, RequestGroup] = {}
        self._requests: dict[str, tuple[RequestGroup, int]] = {}
        # Finished requests whose worker-side state (sampling streams, proposer KV) is
        # released at the end of the step.
        self._finished_ids: list[str] = []
        # Groups with a request the engine failed this step (their output is reported).
        self._failed_groups: list[RequestGroup] = []
        # Optional step tracer (tokenmill.profile.StepTracer); None costs nothing.
        self.tracer = None

    @classmethod
    def from_kwargs(cls, model: str | None = None, progress: bool = True, **kwargs
                    ) -> LLMEngine:
        if model is not None:
            kwargs["model"] = model
        return cls(EngineConfig.from_kwargs(**kwargs), progress=progress)

    def _eos_ids(self, generation_config: dict) -> frozenset[int]:
        eos = generation_config.get("eos_token_id")
        if eos is None:
            eos = list(self.arch.eos_token_ids) or self.tokenizer.eos_token_id
        ids = eos if isinstance(eos, list) else [eos]
        return frozenset(int(i) for i in ids if i is not None)

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ---- requests ----------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return self.inputs.encode(prompt)

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> int:
        """Check a prompt against the model and pool; returns the effective max_tokens."""
        return self.inputs.validate(token_ids, params)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request; raises ValueError before queueing anything."""
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = self.validate_prompt(token_ids, params)
        thinking = self.inputs.thinking_tokens(token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            child = Request(child_id, token_ids, params, arrival, max_tokens,
                            self.eos_token_ids, sample_index=index, group_id=request_id,
                            thinking=thinking)
            if index and self.config.cache.enable_prefix_caching:
                child.prefix_source = children[0]
            children.append(child)
        group = RequestGroup(request_id, text, token_ids, children,
                             [IncrementalDetokenizer(self.tokenizer.backend_tokenizer, c)
                              for c in children], self.reasoning)
        self.groups[request_id] = group
        for index, child in enumerate(children):
            self._requests[child.request_id] = (group, index)
            self.scheduler.add_request(child)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        group = self.groups.get(request_id)
        if group is None:
            return None
        for child in group.children:
            if not child.is_finished:
                self._finish(child, "abort")
        self._release_finished()
        return self._group_output(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        tracer = self.tracer
        if tracer is not None:
            tracer.begin_step()
        step_started = time.perf_counter()
        speculation = self.speculation
        if speculation is not None:
            speculation.before_schedule(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        if tracer is not None:
            tracer.scheduled(sched, len(self.scheduler.running), len(self.scheduler.waiting))
        keep_hidden = (speculation is not None and speculation.keep_hidden_states(
            sched, self.info.needs_hidden_states))
        step = build_step(sched, self.kv_manager, keep_hidden)
        step.rebalance_experts = self._rebalance_due()
        started = time.perf_counter()
        output = self._execute(step)
        if tracer is not None:
            tracer.worker_step(output.phase_seconds)
        if output.expert_load:
            self.expert_load.record(output.expert_load, time.monotonic())
        for key, (keys, queries) in output.sparse_attention.items():
            self.stats.sparse_attention_keys += keys
            self.stats.sparse_attention_queries += queries
            entry = self.stats.sparse_attention_by_layer.setdefault(key, [0, 0])
            entry[0] += keys
            entry[1] += queries
        if output.rank_load:
            self.rank_load.record(output.rank_load, time.monotonic())
            self.expert_moves += output.expert_moves
            self.expert_rebalance_s += output.phase_seconds.get("expert_rebalance", 0.0)
        if output.failed:
            sched, step = self._fail_requests(sched, step, output.failed)
        if speculation is not None:
            speculation.after_execute(sched, step, output, time.perf_counter() - started)
        generated_before = self.stats.generation_tokens
        outputs = self._update_requests(sched, step, output)
        if speculation is not None:
            speculation.after_step(time.perf_counter() - step_started,
                                   self.stats.generation_tokens - generated_before,
                                   any(r.num_spec_tokens for r in step.requests),
                                   len(sched.scheduled))
        self._release_finished()
        if tracer is not None:
            tracer.end_step()
        return outputs

    def _rebalance_due(self) -> bool:
        """Whether replicated experts are re-planned before this step: once per
        --expert-balance-window-s (0: every step), decided here for every rank."""
        parallel = self.config.parallel
        if not parallel.expert_redundant_slots:
            return False
        now = time.monotonic()
        if now - self._balanced_at < parallel.expert_balance_window_s:
            return False
        self._balanced_at = now
        return True

    def _execute(self, step: StepInput) -> StepOutput:
        """Run the step; if it fails, run its requests one at a time, so that a request
        that makes a step fail fails alone (StepOutput.failed) and the others go on with
        exactly the tokens they would have had (greedy and seeded sampling)."""
        try:
            return self.executor.execute(step)
        except WorkerDiedError:
            raise
        except Exception as exc:
            if len(step.requests) == 1:
                logger.exception("step failed for request %s", step.requests[0].request_id)
                return StepOutput(failed={step.requests[0].request_id: repr(exc)})
            logger.exception("step of %d requests failed; retrying them one at a time",
                             len(step.requests))
        merged = StepOutput()
        for index, request in enumerate(step.requests):
            single = StepInput([request], step.preempted_request_ids if index == 0 else [],
                               step.keep_hidden_states)
            try:
                merged.outputs.update(self.executor.execute(single).outputs)
            except WorkerDiedError:
                raise
            except Exception as exc:
                logger.exception("request %s fails a step on its own", request.request_id)
                merged.failed[request.request_id] = repr(exc)
        return merged

    def _fail_requests(self, sched: SchedulerOutput, step: StepInput, failed: dict[str, str]
                       ) -> tuple[SchedulerOutput, StepInput]:
        """Finish the failed requests ("error"); the step without them."""
        kept = [(pair, scheduled) for pair, scheduled in zip(sched.scheduled, step.requests,
                                                             strict=True)
                if scheduled.request_id not in failed]
        for request, _ in sched.scheduled:
            if request.request_id in failed:
                request.error = f"the engine failed while running this request: " \
                                f"{failed[request.request_id]}"
                self._finish(request, "error")
                group, _ = self._requests[request.request_id]
                self._failed_groups.append(group)
        sched = dataclasses.replace(sched, scheduled=[pair for pair, _ in kept])
        step = dataclasses.replace(step, requests=[scheduled for _, scheduled in kept])
        return sched, step

    def _update_requests(self, sched: SchedulerOutput, step: StepInput, output: StepOutput
                         ) -> list[RequestOutput]:
        self.stats.num_steps += 1
        now = time.monotonic()
        touched: dict[str, RequestGroup] = {g.request_id: g for g in self._failed_groups}
        self._failed_groups = []
        for (request, num_new), scheduled in zip(sched.scheduled, step.requests, strict=True):
            group, index = self._requests[request.request_id]
            touched[group.request_id] = group
            self.stats.prompt_tokens += max(0, min(
                request.num_prompt_tokens - request.num_computed_tokens, num_new))
            result = output.outputs.get(request.request_id)
            emitted = result.token_ids if result is not None else []
            # A verification computed the last real token and the accepted drafts; the
            # rejected ones' slots hold stale K/V that later steps overwrite.
            request.num_computed_tokens += len(emitted) if scheduled.num_spec_tokens else num_new
            if result is not None and result.prompt_logprobs:
                request.prompt_logprobs.extend(result.prompt_logprobs)
            logprobs = result.logprobs if result is not None else None
            for position, token in enumerate(emitted):
                self._emit(request, token, logprobs[position] if logprobs else None, now,
                           group.detokenizers[index])
                if request.is_finished:
                    break
            # After the tokens are appended: accepted drafts are computed tokens now.
            self.kv_manager.cache_full_blocks(request)
        return [self._group_output(g) for g in touched.values()]

    def _emit(self, request: Request, token: int, logprob: TokenLogprob | None, now: float,
              detok: IncrementalDetokenizer) -> None:
        request.append_token(token)
        self.stats.generation_tokens += 1
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        if request.logprobs is not None and logprob is not None:
            request.logprobs.append(logprob)
            request.cumulative_logprob += logprob.logprob
        reason = check_stop(request, token, detok, self.max_model_len)
        if reason is not None:
            self._finish(request, reason)

    def _finish(self, request: Request, reason: str) -> None:
        self.scheduler.finish_request(request, reason)
        request.metrics.finished_time = time.monotonic()
        if request.thinking is not None:
            request.metrics.num_thinking_tokens = thinking_progress(
                request.output_token_ids, request.thinking).num_thinking_tokens
        if self.speculation is not None:
            self.speculation.release(request)
        self._finished_ids.append(request.request_id)
        self.stats.finished_requests += 1

    def _release_finished(self) -> None:
        if self._finished_ids:
            self.executor.release(self._finished_ids)
            self._finished_ids = []

    def _group_output(self, group: RequestGroup) -> RequestOutput:
        output = group_output(group)
        if output.finished:
            self.groups.pop(group.request_id, None)
            for child in group.children:
                self._requests.pop(child.request_id, None)
        return output

    # ---- introspection -------------------------------------------------------------------
    def check_integrity(self) -> None:
        """The core's structures, and the worker's (idle: no request may hold any)."""
        self.scheduler.check_integrity()
        self.executor.check_integrity(idle=not self.has_unfinished_requests())

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def run_to_completion(self, request_ids: Iterable[str] | None = None) -> dict[str, RequestOutput]:
        """Step until every request (or the given ones) finishes; returns final outputs."""
        wanted = set(request_ids) if request_ids is not None else None
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for output in self.step():
                if output.finished and (wanted is None or output.request_id in wanted):
                    final[output.request_id] = output
        return final
