"""The synchronous engine: add requests, call step() until they finish.

step() = schedule -> one model forward over the flattened batch -> sample ->
update requests (computed tokens, prefix-cache registration, detokenisation,
stop checks) -> free the blocks of finished requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tokenmill.config import EngineConfig
from tokenmill.core.kv_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.memory import plan_kv_blocks
from tokenmill.layers.products import product_policy
from tokenmill.model.loader import load_model, resolve_device, resolve_dtype
from tokenmill.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParams
from tokenmill.speculative.controller import SpecController
from tokenmill.speculative.factory import build_proposer

logger = logging.getLogger(__name__)


@dataclass
class RequestGroup:
    """One user request: a prompt and its n sampled completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]

    @property
    def finished(self) -> bool:
        return all(child.is_finished for child in self.children)


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    finished_requests: int = 0
    # Speculative decoding: draft tokens verified and accepted, and per draft position
    # (0 = the first token after the context) how many were verified and accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    spec_drafted_by_position: list[int] = field(default_factory=list)
    spec_accepted_by_position: list[int] = field(default_factory=list)

    @property
    def spec_acceptance_rate(self) -> float | None:
        if not self.spec_draft_tokens:
            return None
        return self.spec_accepted_tokens / self.spec_draft_tokens

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens emitted per verification (accepted drafts + the target's token)."""
        if not self.spec_verifications:
            return None
        return (self.spec_accepted_tokens + self.spec_verifications) / self.spec_verifications

    def record_verification(self, num_drafted: int, num_accepted: int) -> None:
        self.spec_verifications += 1
        self.spec_draft_tokens += num_drafted
        self.spec_accepted_tokens += num_accepted
        grow = num_drafted - len(self.spec_drafted_by_position)
        if grow > 0:
            self.spec_drafted_by_position.extend([0] * grow)
            self.spec_accepted_by_position.extend([0] * grow)
        for position in range(num_drafted):
            self.spec_drafted_by_position[position] += 1
            self.spec_accepted_by_position[position] += position < num_accepted


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        mcfg = config.model
        if mcfg.num_threads is not None:
            torch.set_num_threads(mcfg.num_threads)
        torch.manual_seed(mcfg.seed)
        device = resolve_device(mcfg.device)
        self.products = product_policy(mcfg.cpu_blas, device, resolve_dtype(mcfg.dtype, device))
        self.products.configure_threads(mcfg.num_threads or torch.get_num_threads())
        loaded = load_model(mcfg.model, mcfg.dtype, mcfg.device, mcfg.max_model_len,
                            progress=progress, select_linear=self.products.selector)
        arch = loaded.arch
        max_model_len = mcfg.max_model_len or arch.max_position_embeddings
        if arch.sliding_window is not None and arch.sliding_window < max_model_len:
            # Attention is exact full attention; within the window that equals the
            # sliding-window model, so the context is capped there.
            logger.warning("capping max_model_len at the model's sliding window %d",
                           arch.sliding_window)
            max_model_len = arch.sliding_window
        self.config = config = config.with_max_model_len(max_model_len)
        self.max_model_len = max_model_len
        self.arch = arch
        self.device = loaded.device
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(mcfg.model)
        self.eos_token_ids = self._eos_ids(loaded.generation_config)
        self.generation_defaults = loaded.generation_config

        plan = plan_kv_blocks(config, arch, loaded.dtype, loaded.device)
        self.kv_plan = plan
        logger.info("KV cache (%s): %d blocks of %d tokens (%.1f MiB), %d tokens, "
                    "%d concurrent sequences at %d tokens", plan.kv_cache_dtype,
                    plan.num_blocks, config.cache.block_size, plan.total_bytes / 2**20,
                    plan.num_tokens, plan.max_concurrent_sequences, max_model_len)
        self.kv_manager = KVCacheManager(plan.num_blocks, config.cache.block_size,
                                         config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.runner = ModelRunner(loaded.model, arch, plan.num_blocks, config.cache.block_size,
                                  loaded.device, loaded.dtype, seed=mcfg.seed,
                                  kv_cache_dtype=config.cache.kv_cache_dtype)
        self.proposer = build_proposer(config, arch, loaded, plan.num_blocks, progress,
                                       self.products.selector)
        # Verification rows cost as the products pad them (see SpecController).
        self.spec_controller = (SpecController(config.spec, self.products.padded_rows)
                                if self.proposer else None)
        self.runner.keep_hidden = bool(self.proposer and self.proposer.needs_hidden_states)
        self.groups: dict[str, RequestGroup] = {}
        self._requests: dict[str, tuple[RequestGroup, int]] = {}
        self.stats = EngineStats()
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

    # ---- requests ----------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request; raises ValueError before queueing anything."""
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = self.validate_prompt(token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            child = Request(child_id, token_ids, params, arrival, max_tokens,
                            self.eos_token_ids, sample_index=index, group_id=request_id)
            if index and self.config.cache.enable_prefix_caching:
                child.prefix_source = children[0]
            children.append(child)
        group = RequestGroup(request_id, text, token_ids, children,
                             [IncrementalDetokenizer(self.tokenizer.backend_tokenizer, c)
                              for c in children])
        self.groups[request_id] = group
        for index, child in enumerate(children):
            self._requests[child.request_id] = (group, index)
            self.scheduler.add_request(child)

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> int:
        """Check a prompt against the model and pool; returns the effective max_tokens."""
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.arch.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens; it must be shorter than the "
                             f"model's context of {self.max_model_len} tokens")
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        need = self.kv_manager.blocks_needed(len(token_ids) + max_tokens)
        if need > self.kv_manager.num_blocks:
            raise ValueError(
                f"max_tokens: prompt ({len(token_ids)}) + max_tokens ({max_tokens}) needs {need} "
                f"KV blocks but the pool has {self.kv_manager.num_blocks}; lower max_tokens "
                "or give the KV cache more memory")
        if params.prompt_logprobs is not None and len(token_ids) < 1:
            raise ValueError("prompt_logprobs needs a prompt")
        return max_tokens

    def abort_request(self, request_id: str) -> RequestOutput | None:
        group = self.groups.get(request_id)
        if group is None:
            return None
        for child in group.children:
            if not child.is_finished:
                self._finish(child, "abort")
        return self._group_output(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self.products.step_context():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        tracer = self.tracer
        if tracer is not None:
            tracer.begin_step()
        step_started = time.perf_counter()
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        if self.proposer is not None:
            for victim in sched.preempted:
                self.proposer.release(victim.request_id)
        if sched.is_empty:
            return []
        if tracer is not None:
            tracer.scheduled(sched, len(self.scheduler.running), len(self.scheduler.waiting))
        tables = {r.request_id: self.kv_manager.get_block_table(r.request_id)
                  for r, _ in sched.scheduled}
        # Every row one real token on a cached context (plus its speculative ones):
        # the steps the controller's fits and guard compare.
        decode_only = self.spec_controller is not None and all(
            r.num_computed_tokens == r.num_tokens - 1 > 0 for r, _ in sched.scheduled)
        if self.proposer is not None and self.proposer.needs_hidden_states:
            self.runner.keep_hidden = self.spec_controller.wants_features(
                len(sched.scheduled))
        started = time.perf_counter()
        result = self.runner.execute(sched, tables)
        if decode_only:
            self.spec_controller.record_forward(sched.num_batched_tokens,
                                                time.perf_counter() - started)
        generated_before = self.stats.generation_tokens
        self.stats.num_steps += 1
        now = time.monotonic()
        touched: dict[str, RequestGroup] = {}
        for request, num_new in sched.scheduled:
            group, index = self._requests[request.request_id]
            touched[group.request_id] = group
            prompt_part = max(0, min(request.num_prompt_tokens - request.num_computed_tokens,
                                     num_new))
            self.stats.prompt_tokens += prompt_part
            first_position = request.num_computed_tokens
            emitted = result.spec_tokens.get(request.request_id)
            if emitted is not None:
                logprobs = result.spec_logprobs.get(request.request_id)
                num_verified = self._record_verification(request, len(emitted) - 1)
            else:
                token = result.sampled.get(request.request_id)
                emitted = [token] if token is not None else []
                logprob = result.logprobs.get(request.request_id)
                logprobs = [logprob] if logprob is not None else None
                num_verified = num_new
            request.num_computed_tokens += num_verified
            if request.request_id in result.prompt_logprobs:
                request.prompt_logprobs.extend(result.prompt_logprobs[request.request_id])
            if request.request_id in result.hidden:
                self.proposer.observe(request, first_position,
                                      result.hidden[request.request_id][:num_verified])
            for position, token in enumerate(emitted):
                self._emit(request, token, logprobs[position] if logprobs else None, now,
                           group.detokenizers[index])
                if request.is_finished:
                    break
            # After the tokens are appended: accepted drafts are computed tokens now.
            self.kv_manager.cache_full_blocks(request)
        outputs = [self._group_output(g) for g in touched.values()]
        if decode_only:
            self.spec_controller.record_step(time.perf_counter() - step_started,
                                             self.stats.generation_tokens - generated_before,
                                             speculated=bool(result.spec_tokens),
                                             batch=len(sched.scheduled))
        if tracer is not None:
            tracer.end_step()
        return outputs

    def _emit(self, request: Request, token: int, logprob: TokenLogprob | None, now: float,
              detok: IncrementalDetokenizer) -> None:
        request.append_token(token)
        self.stats.generation_tokens += 1
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        if request.logprobs is not None and logprob is not None:
            request.logprobs.append(logprob)
            request.cumulative_logprob += logprob.logprob
        self._check_stop(request, token, detok)

    # ---- speculative decoding --------------------------------------------------------------
    def _propose(self) -> None:
        """Draft tokens for running decodes that may speculate, k chosen per request."""
        candidates, limits = [], []
        for request in self.scheduler.running:
            request.spec_token_ids, request.spec_probs = [], None
            if request.num_tokens_to_compute != 1:
                continue
            params = request.sampling_params
            if params.uses_penalties or request.num_output_tokens < params.min_tokens:
                continue  # their logits depend on every earlier output token
            # Room left: drafts never run past max_tokens or the context.
            limit = min(request.max_tokens - request.num_output_tokens - 1,
                        self.max_model_len - request.num_tokens)
            if limit > 0:
                candidates.append(request)
                limits.append(limit)
        if not candidates:
            return
        plan = self.spec_controller.plan(candidates, limits)
        chosen = [(r, k) for r, k in zip(candidates, plan, strict=True) if k > 0]
        if not chosen:
            return
        started = time.perf_counter()
        proposals = self.proposer.propose([r for r, _ in chosen], [k for _, k in chosen])
        drafted = 0
        for (request, k), proposal in zip(chosen, proposals, strict=True):
            request.spec_token_ids = proposal.token_ids[:k]
            request.spec_probs = (proposal.probs[:k] if proposal.probs is not None
                                  and request.spec_token_ids else None)
            drafted += len(request.spec_token_ids)
        self.spec_controller.record_propose(drafted, time.perf_counter() - started)
        if self.tracer is not None:
            self.tracer.mark("propose")

    def _record_verification(self, request: Request, num_accepted: int) -> int:
        """Account one verification; returns the positions whose KV is now valid."""
        num_drafted = len(request.spec_token_ids)
        self.stats.record_verification(num_drafted, num_accepted)
        request.metrics.spec_draft_tokens += num_drafted
        request.metrics.spec_accepted_tokens += num_accepted
        self.spec_controller.record_verify(request, num_drafted, num_accepted)
        request.spec_token_ids, request.spec_probs = [], None
        # The last real token and the accepted drafts; rejected slots are rewritten later.
        return 1 + num_accepted

    def _check_stop(self, request: Request, token: int, detok: IncrementalDetokenizer) -> None:
        params = request.sampling_params
        may_stop = request.num_output_tokens >= params.min_tokens
        stop_string = detok.add_token(request, token, find_stop=may_stop)
        if may_stop:
            if not params.ignore_eos and token in request.eos_token_ids:
                return self._finish(request, "stop")
            if token in params.stop_token_ids:
                request.stop_reason = token
                return self._finish(request, "stop")
            if stop_string is not None:
                request.stop_reason = stop_string
                return self._finish(request, "stop")
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: str) -> None:
        self.scheduler.finish_request(request, reason)
        request.metrics.finished_time = time.monotonic()
        self.runner.release(request.request_id)
        request.spec_token_ids, request.spec_probs = [], None
        if self.proposer is not None:
            self.proposer.release(request.request_id)
            self.spec_controller.release(request.request_id)
        self.stats.finished_requests += 1

    def _group_output(self, group: RequestGroup) -> RequestOutput:
        outputs = []
        for index, (child, detok) in enumerate(zip(group.children, group.detokenizers,
                                                   strict=True)):
            outputs.append(CompletionOutput(
                index=index, text=detok.visible_text(child), token_ids=child.output_token_ids,
                finish_reason=child.finish_reason, stop_reason=child.stop_reason,
                logprobs=list(child.logprobs) if child.logprobs is not None else None,
                cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
                metrics=child.metrics))
        finished = group.finished
        first = group.children[0]
        output = RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs,
                               finished, prompt_logprobs=first.prompt_logprobs,
                               num_cached_tokens=first.metrics.num_cached_tokens)
        if finished:
            self.groups.pop(group.request_id, None)
            for child in group.children:
                self._requests.pop(child.request_id, None)
        return output

    # ---- introspection -------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

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

