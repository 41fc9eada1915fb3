"""Turn a SchedulerOutput into one flattened batch, run the model, sample.

Layout of a step's batch: decode tokens first (one per decoding request), then each
prefill chunk. Logits are computed only at the rows that produce a token (the last
token of a request that reaches its end) and, for requests that asked for them, at
the prompt positions of the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.attention.base import AttentionBackend, AttentionMetadata, PrefillChunk
from tokenmill.attention.paged import PagedAttention
from tokenmill.core.request import Request
from tokenmill.core.scheduler import SchedulerOutput
from tokenmill.kv import KVCache
from tokenmill.kv.quant import storage_dtype
from tokenmill.layers.sampler import build_sampling_batch, sample, token_logprobs
from tokenmill.model.arch import ArchConfig
from tokenmill.outputs import TokenLogprob
from tokenmill.speculative.verify import processed_probs, verify_greedy, verify_sampled


@dataclass
class StepResult:
    # request_id -> sampled token id (only requests that reached their end this step).
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # request_id -> logprobs of prompt tokens computed this step, in order.
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Speculating requests: request_id -> emitted tokens (accepted drafts, then the
    # corrected or bonus token), and their logprobs when asked for.
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # With keep_hidden: request_id -> final hidden states [n, h] of the positions
    # computed this step (from num_computed_tokens on, speculative ones included).
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arch: ArchConfig, num_blocks: int,
                 block_size: int, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 backend: AttentionBackend | None = None, kv_cache_dtype: str = "auto"
                 ) -> None:
        self.model = model
        self.arch = arch
        self.block_size = block_size
        self.device = device
        self.backend = backend or PagedAttention()
        storage = storage_dtype(kv_cache_dtype, dtype)
        self.kv_caches = [KVCache.allocate(num_blocks, block_size, arch.num_kv_heads,
                                           arch.head_dim, storage, dtype, device)
                          for _ in range(arch.num_layers)]
        self.generator = torch.Generator().manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        # Optional step tracer (tokenmill.profile.StepTracer); None costs nothing.
        self.tracer = None
        # Return every computed position's hidden state (for the EAGLE proposer).
        self.keep_hidden = False

    def release(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def _generator_for(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        gen = self._request_generators.get(request.request_id)
        if gen is None:
            # Children of one n>1 request get distinct streams from the same seed.
            gen = torch.Generator().manual_seed(seed + request.sample_index)
            self._request_generators[request.request_id] = gen
        return gen

    def prepare(self, scheduled: list[tuple[Request, int]], block_tables: dict[str, list[int]]
                ) -> tuple[list[tuple[Request, int]], torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The flattened batch for (request, num_new_tokens) pairs.

        Returns (batch order, token ids, positions, attention metadata). A request's
        tokens are all_token_ids followed by its speculative tokens (if any). Public so
        that proposers with their own KV pool (draft model, EAGLE head) build their
        batches the same way.
        """
        # New tokens on top of a cached context (one, or one plus speculative tokens)
        # run on the batched decode path.
        decodes = [(r, n) for r, n in scheduled if r.num_computed_tokens > 0
                   and n == 1 + len(r.spec_token_ids)]
        decode_ids = {id(r) for r, _ in decodes}
        prefills = [(r, n) for r, n in scheduled if id(r) not in decode_ids]
        ordered = decodes + prefills

        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        size = self.block_size
        for request, num_new in ordered:
            start = request.num_computed_tokens
            table = block_tables[request.request_id]
            ids, end = request.all_token_ids, start + num_new
            tokens.extend(ids[start:end])
            if end > len(ids):  # the speculative tokens follow the real ones
                tokens.extend(request.spec_token_ids[max(start - len(ids), 0):end - len(ids)])
            for pos in range(start, start + num_new):
                positions.append(pos)
                slots.append(table[pos // size] * size + pos % size)
        metadata = self._attention_metadata(decodes, prefills, block_tables, slots)
        device = self.device
        token_tensor = torch.tensor(tokens, dtype=torch.int64, device=device)
        position_tensor = torch.tensor(positions, dtype=torch.int64, device=device)
        return ordered, token_tensor, position_tensor, metadata

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> StepResult:
        ordered, token_tensor, position_tensor, metadata = self.prepare(sched.scheduled,
                                                                        block_tables)
        tracer = self.tracer
        if tracer is not None:
            tracer.mark("prepare_inputs")
        hidden = self.model(token_tensor, position_tensor, self.kv_caches, metadata, self.backend)
        if tracer is not None:
            tracer.mark("forward")
        result = self._sample(ordered, hidden)
        if tracer is not None:
            tracer.mark("sample")
        return result

    def _attention_metadata(self, decodes: list[tuple[Request, int]],
                            prefills: list[tuple[Request, int]],
                            block_tables: dict[str, list[int]], slots: list[int]
                            ) -> AttentionMetadata:
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_decode_tokens=sum(n for _, n in decodes), decode_block_tables=None,
            decode_seq_lens=None, decode_mask=None, prefills=[])
        if decodes:
            tables = [block_tables[r.request_id] for r, _ in decodes]
            width = max(len(t) for t in tables)
            padded = [t + [0] * (width - len(t)) for t in tables]
            contexts = torch.tensor([r.num_computed_tokens for r, _ in decodes],
                                    dtype=torch.int64, device=device)
            lengths = torch.tensor([n for _, n in decodes], dtype=torch.int64, device=device)
            key_pos = torch.arange(width * self.block_size, device=device)
            metadata.decode_block_tables = torch.tensor(padded, dtype=torch.int64, device=device)
            metadata.decode_seq_lens = contexts + lengths
            query_len = max(n for _, n in decodes)
            metadata.decode_query_len = query_len
            if query_len == 1:
                metadata.decode_mask = (key_pos[None, :] <= contexts[:, None])[:, None, None, :]
            else:
                # Query r of a row sees its context and the row's tokens up to r. Padding
                # queries (rows shorter than query_len) copy the row's last query, so no
                # row is fully masked; their outputs are dropped.
                offsets = torch.arange(query_len, device=device)
                last = torch.minimum(offsets[None, :], (lengths - 1)[:, None])
                limit = contexts[:, None] + last  # [D, query_len]
                metadata.decode_mask = (key_pos[None, None, :] <= limit[:, :, None])[:, None]
                metadata.decode_query_index = torch.cat(
                    [row * query_len + torch.arange(n, device=device)
                     for row, (_, n) in enumerate(decodes)])
        offset = metadata.num_decode_tokens
        for request, num_new in prefills:
            table = block_tables[request.request_id]
            seq_len = request.num_computed_tokens + num_new
            used = table[:-(-seq_len // self.block_size)]
            metadata.prefills.append(PrefillChunk(
                start=offset, end=offset + num_new, context_len=request.num_computed_tokens,
                block_table=torch.tensor(used, dtype=torch.int64, device=device)))
            offset += num_new
        return metadata

    def _sample(self, ordered: list[tuple[Request, int]], hidden: torch.Tensor) -> StepResult:
        result = StepResult()
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        spec_rows: list[int] = []
        spec_requests: list[Request] = []
        offset = 0
        for request, num_new in ordered:
            end = request.num_computed_tokens + num_new
            if self.keep_hidden:
                result.hidden[request.request_id] = hidden[offset:offset + num_new]
            if request.prompt_logprobs is not None:
                self._prompt_logprobs(request, num_new, hidden[offset:offset + num_new], result)
            if request.spec_token_ids and end > request.num_tokens:
                # Verification: the target's distribution after each speculative prefix.
                spec_rows.extend(range(offset, offset + num_new))
                spec_requests.append(request)
            elif end == request.num_tokens:
                sample_rows.append(offset + num_new - 1)
                sample_requests.append(request)
            offset += num_new
        if spec_requests:
            self._verify(spec_requests, self.model.compute_logits(hidden[spec_rows]), result)
        if not sample_requests:
            return result
        logits = self.model.compute_logits(hidden[sample_rows])
        if self.tracer is not None:
            self.tracer.mark("logits")
        params = [r.sampling_params for r in sample_requests]
        banned = [(row, sorted(r.eos_token_ids | set(r.sampling_params.stop_token_ids)))
                  for row, r in enumerate(sample_requests)
                  if r.num_output_tokens < r.sampling_params.min_tokens]
        histories = [(r.prompt_token_ids, r.output_token_ids) for r in sample_requests]
        batch = build_sampling_batch(params, histories, banned,
                                     [self._generator_for(r) for r in sample_requests],
                                     logits.shape[-1], logits.device)
        out = sample(logits, batch, self.generator)
        token_ids = out.token_ids.tolist()
        for row, request in enumerate(sample_requests):
            result.sampled[request.request_id] = token_ids[row]
        if out.logprobs is not None:
            chosen, ranks = out.logprobs.tolist(), out.ranks.tolist()
            top_ids, top_lps = out.top_ids.tolist(), out.top_logprobs.tolist()
            for row, request in enumerate(sample_requests):
                num_top = request.sampling_params.logprobs
                if num_top is None:
                    continue
                result.logprobs[request.request_id] = TokenLogprob(
                    token_ids[row], chosen[row], ranks[row],
                    list(zip(top_ids[row][:num_top], top_lps[row][:num_top], strict=True)))
        return result

    def _verify(self, requests: list[Request], logits: torch.Tensor, result: StepResult) -> None:
        """Accept or reject each request's speculative tokens (k + 1 logits rows each)."""
        row = 0
        greedy_choice = logits.argmax(dim=-1).tolist()
        for request in requests:
            draft = request.spec_token_ids
            rows = slice(row, row + len(draft) + 1)
            params = request.sampling_params
            if params.temperature == 0:
                emitted = verify_greedy(greedy_choice[rows], draft)
            else:
                p = processed_probs(logits[rows], [params] * (len(draft) + 1))
                emitted = verify_sampled(p, draft, request.spec_probs,
                                         self._generator_for(request) or self.generator)
            result.spec_tokens[request.request_id] = emitted
            if request.logprobs is not None:
                result.spec_logprobs[request.request_id] = logprob_entries(
                    logits[row:row + len(emitted)].log_softmax(dim=-1), emitted, params.logprobs)
            row += len(draft) + 1

    def _prompt_logprobs(self, request: Request, num_new: int, hidden: torch.Tensor,
                         result: StepResult) -> None:
        """Logprobs of the prompt tokens that this chunk's positions predict."""
        start = request.num_computed_tokens
        # Position p predicts token p + 1; only prompt tokens not yet reported.
        first = max(start, len(request.prompt_logprobs) - 1)
        last = min(start + num_new, request.num_prompt_tokens - 1)
        if first >= last:
            return
        logprobs = self.model.compute_logits(hidden[first - start:last - start]).log_softmax(-1)
        result.prompt_logprobs[request.request_id] = logprob_entries(
            logprobs, request.prompt_token_ids[first + 1:last + 1],
            request.sampling_params.prompt_logprobs)


def logprob_entries(logprobs: torch.Tensor, targets: list[int], num_top: int
                    ) -> list[TokenLogprob]:
    """TokenLogprob of targets[i] under row i of logprobs, with num_top alternatives."""
    target_tensor = torch.tensor(targets, dtype=torch.int64, device=logprobs.device)
    chosen, ranks, top_ids, top_lps = token_logprobs(logprobs, target_tensor, num_top)
    return [TokenLogprob(t, c, r, list(zip(i, lp, strict=True)))
            for t, c, r, i, lp in zip(targets, chosen.tolist(), ranks.tolist(),
                                      top_ids.tolist(), top_lps.tolist(), strict=True)]
