"""After the forward: choose the next token where a request reaches its end, verify
speculative tokens, and report logprobs (sampled tokens' and prompt tokens').

Logits are computed only at the rows that produce a token (the last row of a request
that reaches its end, every row of a verification) and at the prompt positions whose
logprobs were asked for. Each position's logits pass through the request's logits
processors (layers/logits_processors.py) with the history that precedes it, so a
verification row i sees the drafts before it as output. A seeded request's draws are
keyed by its seed, sample index and token position (layers/sampler.py
`position_uniform`): the same tokens whatever shares the batch, across preemptions,
and with speculation on or off (its drafts are verified by sampling and comparing);
unseeded requests share one generator seeded from the engine's seed.
"""

from __future__ import annotations

import torch

from tokenmill.core.step import (
    SamplingRequest,
    ScheduledRequest,
    StepOutput,
)
from tokenmill.layers.logits_processors import (
    LogitsProcessor,
    TokenHistory,
    apply_logits_processors,
    build_logits_processors,
)
from tokenmill.layers.rejection_sampler import (
    processed_probs,
    verify_by_sampling,
    verify_greedy,
    verify_sampled,
)
from tokenmill.layers.sampler import (
    build_sampling_batch,
    greedy,
    position_uniform,
    sample,
    token_logprobs,
)
from tokenmill.outputs import TokenLogprob
from tokenmill.runner.model_runner import PreparedBatch

ProcessedRow = tuple[list[LogitsProcessor], TokenHistory]


class StepSampler:
    def __init__(self, model: torch.nn.Module, seed: int = 0) -> None:
        self.model = model  # its compute_logits turns hidden states into logits
        # Unseeded requests' draws: one stream for the engine, seeded from its seed.
        self.generator = torch.Generator().manual_seed(seed)
        # Optional step tracer (tokenmill.profile.StepTracer); None costs nothing.
        self.tracer = None

    def run(self, requests: list[ScheduledRequest], batch: PreparedBatch,
            hidden: torch.Tensor, draft_probs: dict[str, torch.Tensor]) -> StepOutput:
        """draft_probs: request id -> the distributions its sampled drafts came from."""
        result = StepOutput()
        sample_rows, sampled = [], []
        verify_rows, verified = [], []
        for slot, index in enumerate(batch.order):
            request = requests[index]
            offset = batch.query_start[slot]
            if request.prompt_logprobs is not None:
                self._prompt_logprobs(request, hidden[offset:offset + request.num_new_tokens],
                                      result)
            if request.sampling is None:
                continue
            if request.num_spec_tokens:
                verify_rows.extend(range(offset, offset + request.num_new_tokens))
                verified.append(request)
            else:
                sample_rows.append(offset + request.num_new_tokens - 1)
                sampled.append(request)
        if verified:
            logits = self.model.compute_logits(hidden[verify_rows])
            self._verify(verified, logits, draft_probs, result)
        if sampled:
            logits = self.model.compute_logits(_rows(hidden, sample_rows))
            if self.tracer is not None:
                self.tracer.mark("logits")
            self._sample(sampled, logits, result)
        return result

    def _sample(self, requests: list[ScheduledRequest], logits: torch.Tensor,
                result: StepOutput) -> None:
        samplings = [r.sampling for r in requests]
        params = [s.params for s in samplings]
        per_row = [_processors(s, 0, []) for s in samplings]
        uniforms = [_seeded_uniform(r.sampling, r.num_computed_tokens + r.num_new_tokens)
                    for r in requests]
        batch = build_sampling_batch(params, uniforms, logits.shape[-1], logits.device)
        raw = logits.log_softmax(dim=-1) if batch.num_logprobs is not None else None
        out = sample(apply_logits_processors(logits, per_row), batch, self.generator, raw)
        token_ids = out.token_ids.tolist()
        for row, request in enumerate(requests):
            result.output(request.request_id).token_ids = [token_ids[row]]
        if out.logprobs is None:
            return
        chosen, ranks = out.logprobs.tolist(), out.ranks.tolist()
        top_ids, top_lps = out.top_ids.tolist(), out.top_logprobs.tolist()
        for row, (request, p) in enumerate(zip(requests, params, strict=True)):
            if p.logprobs is not None:
                result.output(request.request_id).logprobs = [TokenLogprob(
                    token_ids[row], chosen[row], ranks[row],
                    list(zip(top_ids[row][:p.logprobs], top_lps[row][:p.logprobs], strict=True)))]

    def _verify(self, requests: list[ScheduledRequest], logits: torch.Tensor,
                draft_probs: dict[str, torch.Tensor], result: StepOutput) -> None:
        """Accept or reject each request's speculative tokens (k + 1 logits rows each)."""
        per_row: list[ProcessedRow] = []
        for request in requests:
            drafts = request.token_ids[-request.num_spec_tokens:]
            per_row.extend(_processors(request.sampling, i, drafts[:i])
                           for i in range(len(drafts) + 1))
        processed = apply_logits_processors(logits, per_row)
        greedy_choice = greedy(processed).tolist()
        row = 0
        for request in requests:
            k, params = request.num_spec_tokens, request.sampling.params
            drafts = request.token_ids[-k:]
            rows = slice(row, row + k + 1)
            if params.temperature == 0:
                emitted = verify_greedy(greedy_choice[rows], drafts)
            elif params.seed is not None:
                # The positions of the k + 1 tokens this verification may emit.
                first = request.num_computed_tokens + 1
                emitted = verify_by_sampling(
                    processed[rows], params, drafts,
                    [_seeded_uniform(request.sampling, first + i) for i in range(k + 1)])
            else:
                q = draft_probs.get(request.request_id)
                p = processed_probs(processed[rows], [params] * (k + 1))
                emitted = verify_sampled(p, drafts, q[:k] if q is not None else None,
                                         self.generator)
            output = result.output(request.request_id)
            output.token_ids = emitted
            if params.logprobs is not None:
                output.logprobs = logprob_entries(
                    logits[row:row + len(emitted)].log_softmax(dim=-1), emitted, params.logprobs)
            row += k + 1

    def _prompt_logprobs(self, request: ScheduledRequest, hidden: torch.Tensor,
                         result: StepOutput) -> None:
        wanted = request.prompt_logprobs
        if wanted is None:
            return
        first = wanted.first_position - request.num_computed_tokens
        rows = hidden[first:first + len(wanted.target_token_ids)]
        logprobs = self.model.compute_logits(rows).log_softmax(dim=-1)
        result.output(request.request_id).prompt_logprobs = logprob_entries(
            logprobs, wanted.target_token_ids, wanted.num_top)


def _rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows] for increasing rows; hidden itself when they are all of its rows (a
    batch of decode tokens), sparing a gather that costs ~0.17 ms with caches cold after
    a step's weight stream."""
    if len(rows) == hidden.shape[0] and rows[-1] == len(rows) - 1:
        return hidden
    return hidden[rows]


def _seeded_uniform(sampling: SamplingRequest, position: int) -> float | None:
    """The uniform of a seeded request's token at sequence position `position`."""
    seed = sampling.params.seed
    return None if seed is None else position_uniform(seed, sampling.sample_index, position)


def _processors(sampling: SamplingRequest, extra: int, extra_ids: list[int]) -> ProcessedRow:
    """The processors at the position `extra` tokens (extra_ids) after the request's end."""
    outputs = sampling.output_token_ids
    history = TokenHistory(sampling.num_output_tokens + extra, sampling.eos_token_ids,
                           sampling.prompt_token_ids,
                           outputs + extra_ids if outputs is not None else None,
                           sampling.thinking)
    return build_logits_processors(sampling.params, history), history


def logprob_entries(logprobs: torch.Tensor, targets: list[int], num_top: int
                    ) -> list[TokenLogprob]:
    """TokenLogprob of targets[i] under row i of logprobs, with num_top alternatives."""
    target_tensor = torch.tensor(targets, dtype=torch.int64, device=logprobs.device)
    chosen, ranks, top_ids, top_lps = token_logprobs(logprobs, target_tensor, num_top)
    return [TokenLogprob(t, c, r, list(zip(i, lp, strict=True)))
            for t, c, r, i, lp in zip(targets, chosen.tolist(), ranks.tolist(),
                                      top_ids.tolist(), top_lps.tolist(), strict=True)]
