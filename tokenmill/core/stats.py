"""Engine counters: tokens, steps, finished requests, speculative acceptance."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # Sparse attention backends: keys attended and (decode query, KV head) pairs, over
    # their sparse layers (keys per query = the first over the second).
    sparse_attention_keys: int = 0
    sparse_attention_queries: int = 0
    # The same per layer and head kind ("selected" for quest and static-topk;
    # "retrieval" and "local" for retrieval-topp): (layer, kind) -> [keys, queries].
    sparse_attention_by_layer: dict[tuple[int, str], list[int]] = field(default_factory=dict)

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
