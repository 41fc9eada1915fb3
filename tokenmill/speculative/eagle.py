"""EAGLE-1 draft head (Li et al., ICML 2024): feature-level autoregression on the
target's own hidden states, and the proposer that drafts with it.

The head. Position t takes the pair (f_t, x_{t+1}): f_t is the target's feature at
position t (its final hidden state *after* the final norm, which is what
`LlamaForCausalLM.forward` returns and what the LM head reads), x_{t+1} the token
that follows. Then

    f_hat_{t+1} = DecoderLayer(FC([f_t ; embed(x_{t+1})]))

and the target's own LM head (shared, not stored with the head) turns f_hat_{t+1}
into logits for x_{t+2}. Knowing x_{t+1} removes the sampling uncertainty that makes
plain feature regression ambiguous. Details chosen here:
- the FC (2h -> h) has a bias, as in EAGLE-1;
- the decoder layer is tokenmill's `DecoderLayer` with the target's attention
  geometry and MLP width, unchanged: it keeps its input RMSNorm (EAGLE-1 drops it
  in layer 0 because its input is an un-normalised residual; here the FC output's
  scale is free, and normalising it keeps training stable);
- no final norm: the head regresses post-norm features directly, so its output is
  already at the scale the LM head expects;
- rotary positions are the target's absolute positions (position of f_t).

On disk a head is a directory with `config.json` (its geometry and the target it
was trained for) and `model.safetensors` (float32, checkpoint layout [out, in]).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tokenmill.attention.base import AttentionBackend, AttentionMetadata
from tokenmill.core.kv_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.kv import KVCache
from tokenmill.layers.linear import (
    Linear,
    LinearSelector,
    bind_linear_methods,
    finalize_linear_methods,
)
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.products import ProductPolicy
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.model.arch import ArchConfig
from tokenmill.model.llama import DecoderLayer, LlamaForCausalLM
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.speculative.base import MAX_CATCH_UP, DraftSampler, Proposal, Proposer
from tokenmill.speculative.verify import processed_probs

FORMAT = "tokenmill-eagle-1"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Fields the head shares with its target: the embedding and LM head are the
# target's, and the decoder layer uses the target's attention geometry.
TARGET_GEOMETRY = ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim")
# Fields that shape the head's own weights.
HEAD_GEOMETRY = TARGET_GEOMETRY + ("intermediate_size", "rms_norm_eps", "qkv_bias",
                                   "o_proj_bias", "mlp_bias", "qk_norm", "rope")
INIT_STD = 0.02


def head_arch(target_arch: ArchConfig) -> ArchConfig:
    """The head's architecture: the target's geometry, one dense decoder layer."""
    return dataclasses.replace(target_arch, num_layers=1, num_experts=0, num_experts_per_tok=0)


class WindowCausalAttention(AttentionBackend):
    """Plain causal attention over equal-length windows, without a KV cache.

    The flattened batch is `num_windows` windows of `window` tokens each; used to
    train the head and as the from-scratch reference for its paged path.
    """

    name = "window-causal"

    def __init__(self, window: int) -> None:
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache | None, metadata: AttentionMetadata | None, scale: float
                ) -> torch.Tensor:
        def windows(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, window, D]
            return x.view(-1, self.window, *x.shape[1:]).transpose(1, 2)

        out = F.scaled_dot_product_attention(windows(q), windows(k), windows(v),
                                             is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape)


class EagleHead(nn.Module):
    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        hidden = arch.hidden_size
        self.fc = Linear(2 * hidden, hidden, bias=True)
        self.layer = DecoderLayer(arch, LlamaForCausalLM.build_mlp(arch))
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope)
        self.rotary.build_cache()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Random initialisation (seed torch first): N(0, 0.02) matrices, zero biases,
        unit norm gains."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.weight.normal_(0.0, INIT_STD)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def place(self, device: torch.device, dtype: torch.dtype) -> EagleHead:
        """Move to device/dtype; the rotary tables stay float32 and are rebuilt there."""
        self.to(device=device, dtype=dtype)
        self.rotary.float()
        self.rotary.build_cache()
        return self

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor,
                positions: torch.Tensor, kv_cache: KVCache | None,
                metadata: AttentionMetadata | None, backend: AttentionBackend) -> torch.Tensor:
        """Predicted next features [T, h] for T flattened pairs (f_t, embed(x_{t+1}))."""
        hidden = self.fc(torch.cat((features, token_embeds), dim=-1))
        rope = self.rotary(positions, hidden.dtype)
        return self.layer(rope, hidden, kv_cache, metadata, backend)

    def forward_windows(self, features: torch.Tensor, token_embeds: torch.Tensor,
                        first_position: int = 0) -> torch.Tensor:
        """Teacher-forced forward over [B, W, h] windows of pairs, each window starting
        at target position first_position; returns [B, W, h]."""
        batch, window, hidden = features.shape
        positions = torch.arange(first_position, first_position + window,
                                 device=features.device).repeat(batch)
        out = self(features.reshape(-1, hidden), token_embeds.reshape(-1, hidden), positions,
                   None, None, WindowCausalAttention(window))
        return out.view(batch, window, hidden)


# ---- saving and loading ------------------------------------------------------------------
def head_config(arch: ArchConfig, target: dict[str, Any]) -> dict[str, Any]:
    """config.json of a head with this arch, trained for `target` (provenance)."""
    geometry = {name: getattr(arch, name) for name in HEAD_GEOMETRY}
    return {"format": FORMAT, **geometry, "target": target}


def save_eagle_head(head: EagleHead, out_dir: Path, target: dict[str, Any]) -> None:
    """Write config.json and model.safetensors (float32, [out, in] matrices)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, param in head.named_parameters():
        owner = head.get_submodule(name.rpartition(".")[0])
        tensor = param.detach()
        if isinstance(owner, Linear) and name.endswith(".weight"):
            tensor = owner.checkpoint_weight()
        tensors[name] = tensor.float().contiguous().cpu()
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": FORMAT})
    config = head_config(head.arch, target)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")


def read_head_config(head_dir: str | Path, target_arch: ArchConfig) -> tuple[ArchConfig, dict]:
    """The head arch and config.json saved in head_dir, checked against the target.

    Raises ValueError when the head was built for a target of another geometry.
    """
    head_dir = Path(head_dir)
    config_path = head_dir / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"EAGLE head: no {CONFIG_FILE} in {str(head_dir)!r}")
    config = json.loads(config_path.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"EAGLE head: {str(config_path)!r} has format "
                         f"{config.get('format')!r}, expected {FORMAT!r}")
    mismatched = [f"{name}: head {config[name]!r}, target {getattr(target_arch, name)!r}"
                  for name in TARGET_GEOMETRY if config[name] != getattr(target_arch, name)]
    if mismatched:
        raise ValueError(f"EAGLE head in {str(head_dir)!r} does not fit this target model ("
                         + "; ".join(mismatched) + ")")
    arch = dataclasses.replace(head_arch(target_arch),
                               **{name: config[name] for name in HEAD_GEOMETRY})
    return arch, config


def load_eagle_head(head_dir: str | Path, target_model: LlamaForCausalLM,
                    select_linear: LinearSelector | None = None) -> EagleHead:
    """The head saved in head_dir, on the target's device and dtype, ready to draft;
    its Linear layers take the methods select_linear picks (default: torch's own).

    Raises ValueError when the head was built for a target of another geometry.
    """
    arch, _ = read_head_config(head_dir, target_model.arch)
    reference = next(target_model.parameters())
    rotary = target_model.model.rotary
    head = EagleHead(arch, rotary.max_positions)
    bind_linear_methods(head, select_linear or ProductPolicy(reference.device).select)
    load_head_weights(head, load_file(str(Path(head_dir) / WEIGHTS_FILE)), Path(head_dir))
    head.place(reference.device, reference.dtype)
    head.eval().requires_grad_(False)
    finalize_linear_methods(head)
    return head


@torch.no_grad()
def load_head_weights(head: EagleHead, tensors: dict[str, torch.Tensor], source: Path) -> None:
    expected = {name for name, _ in head.named_parameters()}
    if set(tensors) != expected:
        raise ValueError(f"EAGLE head weights in {str(source)!r}: missing "
                         f"{sorted(expected - set(tensors))}, unexpected "
                         f"{sorted(set(tensors) - expected)}")
    for name, tensor in tensors.items():
        module_name, _, param_name = name.rpartition(".")
        owner = head.get_submodule(module_name)
        try:
            if isinstance(owner, Linear):
                owner.load(param_name, tensor)
            else:
                getattr(owner, param_name).copy_(tensor)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"EAGLE head tensor {name!r} ({tuple(tensor.shape)}) in "
                             f"{str(source)!r} does not fit: {exc}") from None


# ---- the proposer ------------------------------------------------------------------------
@dataclass(eq=False)
class _DraftSequence:
    """The head's view of one request, shaped like a `Request` for
    `ModelRunner.prepare` and `KVCacheManager`.

    Head position i holds the pair (f_{offset+i}, x_{offset+i+1}); offset is the first
    target position whose feature was observed (> 0 after a prefix-cache hit, whose
    positions the target never computed).
    """

    request_id: str
    offset: int
    features: torch.Tensor  # [capacity, h]; row i = f_{offset+i}
    num_features: int = 0
    # Pairs whose K/V sit in the head's cache. Draft steps write K/V beyond this
    # count; they are never counted, so the next catch-up simply overwrites them.
    num_computed_tokens: int = 0
    # The head's input tokens (x_{offset+1}, ...) and, while drafting, its own drafts.
    all_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    # The request's tokens when this state was last brought up to date: every cached
    # pair and feature depends only on a prefix of them.
    known_token_ids: list[int] = field(default_factory=list)

    def append_features(self, hidden: torch.Tensor) -> None:
        end = self.num_features + hidden.shape[0]
        if end > self.features.shape[0]:
            grown = self.features.new_empty(max(end, 2 * self.features.shape[0]),
                                            self.features.shape[1])
            grown[:self.num_features] = self.features[:self.num_features]
            self.features = grown
        self.features[self.num_features:end] = hidden
        self.num_features = end

    def keep_prefix(self, num_tokens: int) -> None:
        """Forget everything that depends on request tokens at positions >= num_tokens."""
        # f_p depends on x_0..x_p; the pair at position t also on x_{t+1}.
        self.num_features = max(0, min(self.num_features, num_tokens - self.offset))
        self.num_computed_tokens = max(0, min(self.num_computed_tokens,
                                              num_tokens - 1 - self.offset))


@dataclass
class _Draft:
    request: Request
    sequence: _DraftSequence
    num_tokens: int
    num_pairs: int  # verified pairs: up to the request's last token
    token_ids: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class EagleProposer(Proposer):
    """Drafts with an EAGLE head over its own paged KV pool, batched across requests.

    Per step: a catch-up forward over the verified pairs (f_t, x_{t+1}) the head has
    not processed (at least the last one, whose output starts the draft), then
    num_tokens - 1 autoregressive steps that feed the head's predicted feature and
    drafted token back in. Rollback needs no bookkeeping in the normal case, since
    draft steps are never counted as computed; a request whose verified tokens or
    features changed underneath (detected against `known_token_ids` and the
    positions observe() reports) is cut back to what is still valid.
    """

    name = "eagle"
    needs_hidden_states = True

    def __init__(self, head: EagleHead, target: LlamaForCausalLM, num_blocks: int,
                 block_size: int = 16, micro_batch: int | None = None, seed: int = 0) -> None:
        reference = next(head.parameters())
        self.head = head
        self.target = target
        self.device, self.dtype = reference.device, reference.dtype
        self.max_positions = head.rotary.max_positions
        # Most requests per head forward (None: the whole batch).
        self.micro_batch = micro_batch
        self.runner = ModelRunner(head, head.arch, num_blocks, block_size, self.device,
                                  self.dtype)
        self.kv_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.sampler = DraftSampler(seed)
        self._sequences: dict[str, _DraftSequence] = {}

    @classmethod
    def load(cls, head_dir: str | Path, target: LlamaForCausalLM, arch: ArchConfig,
             device: torch.device, dtype: torch.dtype, num_blocks: int, block_size: int = 16,
             micro_batch: int | None = None, seed: int = 0,
             select_linear: LinearSelector | None = None) -> EagleProposer:
        """The proposer for the head saved in head_dir, as `tokenmill.speculative.factory` builds
        it. arch, device and dtype are the target's: the head takes them from target."""
        del arch, device, dtype  # the head is checked against, and placed like, target
        return cls(load_eagle_head(head_dir, target, select_linear), target, num_blocks,
                   block_size, micro_batch, seed)

    # ---- engine interface ----------------------------------------------------------------
    @torch.inference_mode()
    def observe(self, request: Request, first_position: int, hidden: torch.Tensor) -> None:
        # Tokens are checked when drafting starts (_start_draft), not on every step:
        # the target recomputes from any position whose token changed, and reports
        # it here as first_position, which is what cuts the features back.
        sequence = self._sequences.get(request.request_id)
        if sequence is not None:
            if sequence.offset <= first_position <= sequence.offset + sequence.num_features:
                # Features re-sent from first_position on replace what was there.
                sequence.keep_prefix(first_position)
            else:  # a gap, or a rewrite from before the first feature: start over
                self.release(request.request_id)
                sequence = None
        if sequence is None:
            empty = torch.empty(0, hidden.shape[-1], device=self.device, dtype=self.dtype)
            sequence = _DraftSequence(request.request_id, first_position, empty)
            self._sequences[request.request_id] = sequence
        sequence.append_features(hidden.detach().to(self.device, self.dtype))

    def release(self, request_id: str) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None:
            self.kv_manager.free(sequence)
        self.sampler.release(request_id)

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Proposal]:
        drafts = [self._start_draft(r, k) for r, k in zip(requests, num_tokens, strict=True)]
        active = [d for d in drafts if d is not None]
        step = self.micro_batch or len(active) or 1
        for start in range(0, len(active), step):
            self._draft(active[start:start + step])
        proposals = []
        for draft in drafts:
            if draft is None:
                proposals.append(Proposal([]))
                continue
            draft.sequence.num_computed_tokens = draft.num_pairs
            draft.sequence.spec_token_ids = []
            probs = torch.stack(draft.probs) if draft.probs else None
            proposals.append(Proposal(draft.token_ids, probs))
        return proposals

    # ---- steps -----------------------------------------------------------------------------
    def _draft(self, active: list[_Draft]) -> None:
        """Catch-up forward, then one forward per further draft token, batched."""
        active, predicted = self._catch_up(active)
        self._choose(active, predicted)
        for step in range(1, max(d.num_tokens for d in active)):
            keep = [row for row, d in enumerate(active) if d.num_tokens > step]
            active, predicted = self._draft_step([active[row] for row in keep],
                                                 predicted[keep], step)
            self._choose(active, predicted)

    def _start_draft(self, request: Request, num_tokens: int) -> _Draft | None:
        """Bring the request's state up to date and reserve KV; None: no proposal."""
        sequence = self._sequences.get(request.request_id)
        if sequence is None:
            return None
        token_ids = request.all_token_ids
        self._forget_changed_tokens(sequence, token_ids)
        num_pairs = len(token_ids) - 1 - sequence.offset
        if num_pairs - sequence.num_computed_tokens > MAX_CATCH_UP:
            # A long backlog (a new prompt, or steps without speculation): the head
            # restarts on the latest MAX_CATCH_UP positions instead of running them all.
            sequence = self._rebase(sequence, num_pairs - MAX_CATCH_UP)
            num_pairs = len(token_ids) - 1 - sequence.offset
        # The last draft pair sits at target position len + num_tokens - 2.
        num_tokens = min(num_tokens, self.max_positions - len(token_ids) + 1)
        if num_pairs < 1 or sequence.num_features < num_pairs or num_tokens < 1:
            return None  # the latest verified position's feature has not been observed
        # Recompute at least the last pair: its output is where drafting starts.
        sequence.num_computed_tokens = min(sequence.num_computed_tokens, num_pairs - 1)
        new_pairs = num_pairs - sequence.num_computed_tokens
        if not self.kv_manager.allocate_slots(sequence, new_pairs + num_tokens - 1):
            return None
        sequence.all_token_ids = token_ids[sequence.offset + 1:]
        sequence.known_token_ids = list(token_ids)
        return _Draft(request, sequence, num_tokens, num_pairs)

    def _rebase(self, sequence: _DraftSequence, drop: int) -> _DraftSequence:
        """The request's state without its first `drop` positions: their features go,
        the head's cache is freed, and the rest is recomputed at the next catch-up."""
        self.kv_manager.free(sequence)
        kept = sequence.features[drop:sequence.num_features].clone()
        rebased = _DraftSequence(sequence.request_id, sequence.offset + drop, kept)
        rebased.num_features = kept.shape[0]
        rebased.known_token_ids = sequence.known_token_ids
        self._sequences[sequence.request_id] = rebased
        return rebased

    def _forget_changed_tokens(self, sequence: _DraftSequence, token_ids: list[int]) -> None:
        known = sequence.known_token_ids
        if len(known) <= len(token_ids) and token_ids[:len(known)] == known:
            return  # the usual case: tokens were only appended
        common = 0
        for old, new in zip(known, token_ids, strict=False):
            if old != new:
                break
            common += 1
        sequence.keep_prefix(common)
        sequence.known_token_ids = known[:common]

    def _forward(self, drafts: list[_Draft], num_new: list[int], features: list[torch.Tensor]
                 ) -> tuple[list[_Draft], list[int], torch.Tensor]:
        """One head forward over num_new[i] pairs of drafts[i] (input features
        features[i]). Returns the drafts, their counts and the predicted features in
        the batch's order (ModelRunner.prepare puts single-pair rows first)."""
        scheduled = [(d.sequence, n) for d, n in zip(drafts, num_new, strict=True)]
        ordered, token_ids, positions, metadata = self.runner.prepare(
            scheduled, self.kv_manager.block_tables)
        index_of = {id(d.sequence): i for i, d in enumerate(drafts)}
        order = [index_of[id(sequence)] for sequence, _ in ordered]
        drafts = [drafts[i] for i in order]
        num_new = [num_new[i] for i in order]
        offsets = torch.tensor([d.sequence.offset for d in drafts], device=self.device)
        positions = positions + offsets.repeat_interleave(
            torch.tensor(num_new, device=self.device))
        inputs = torch.cat([features[i] for i in order])
        hidden = self.head(inputs, self.target.embed(token_ids), positions,
                           self.runner.kv_caches[0], metadata, self.runner.backend)
        return drafts, num_new, hidden

    def _catch_up(self, drafts: list[_Draft]) -> tuple[list[_Draft], torch.Tensor]:
        """Run the verified pairs the head has not processed; returns the drafts in
        batch order and each one's last predicted feature (the first draft's input)."""
        num_new = [d.num_pairs - d.sequence.num_computed_tokens for d in drafts]
        features = [d.sequence.features[d.sequence.num_computed_tokens:d.num_pairs]
                    for d in drafts]
        drafts, num_new, hidden = self._forward(drafts, num_new, features)
        for draft in drafts:
            draft.sequence.num_computed_tokens = draft.num_pairs
        last_rows = torch.tensor(num_new, device=self.device).cumsum(0) - 1
        return drafts, hidden[last_rows]

    def _draft_step(self, drafts: list[_Draft], predicted: torch.Tensor, step: int
                    ) -> tuple[list[_Draft], torch.Tensor]:
        """Feed each request's (f_hat, latest draft token) back in: one pair each."""
        for draft in drafts:
            draft.sequence.num_computed_tokens = draft.num_pairs + step - 1
            draft.sequence.spec_token_ids = draft.token_ids
        drafts, _, hidden = self._forward(drafts, [1] * len(drafts), list(predicted.split(1)))
        return drafts, hidden

    def _choose(self, drafts: list[_Draft], predicted: torch.Tensor) -> None:
        """Append each request's next draft token: argmax for greedy requests, a draw
        from its processed distribution q (kept for verification) otherwise."""
        logits = self.target.compute_logits(predicted)
        chosen = logits.argmax(dim=-1).tolist()
        sampled_rows = [row for row, d in enumerate(drafts)
                        if d.request.sampling_params.temperature != 0]
        if sampled_rows:
            params = [drafts[row].request.sampling_params for row in sampled_rows]
            q = processed_probs(logits[sampled_rows], params)
            for row, q_row in zip(sampled_rows, q, strict=True):
                drafts[row].probs.append(q_row)
                chosen[row] = self.sampler.draw(q_row, drafts[row].request)
        for draft, token in zip(drafts, chosen, strict=True):
            draft.token_ids.append(token)
