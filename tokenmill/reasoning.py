"""Reasoning models: how a model says it thinks, where its thinking is in its output
(as text, for the API, and as tokens, for the thinking budget), and nothing else.

A model reasons when it writes its thinking between two markers before answering,
`<think> ... </think> answer` (Qwen3, DeepSeek-R1). It declares so in its
generation_config.json:

    "reasoning": {"start": "<think>", "end": "</think>", "bridge": "\n"}

or, without that entry, by having both default markers as single tokens in its
tokenizer (`declared_markers`). The markers must decode as text (added tokens that are
not special), since the split below works on the decoded text.

`split_reasoning` turns the text so far into (reasoning, content). While a request
runs, a tail that could be the beginning of a marker is held back, so both parts only
ever grow by appending: a stream of their differences never shows a partial marker,
and concatenated it equals the final split. `thinking_progress` finds the thinking in
the output's token ids, for the budget's logits processor and the metrics.
Pure Python, no torch: the core, the layers and the engine all read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_START, DEFAULT_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningMarkers:
    """A model's thinking markers, and the text a thinking budget forces before the end
    marker unless a request names its own (its `bridge`; Qwen3 suggests "Considering the
    limited time by the user, I have to give the solution based on the thinking
    directly now.\n")."""

    start: str = DEFAULT_START
    end: str = DEFAULT_END
    bridge: str = ""

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"reasoning.{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.bridge, str):
            raise ValueError(f"reasoning.bridge must be a string, got {self.bridge!r}")


def declared_markers(generation_config: dict, vocab: dict[str, int]) -> ReasoningMarkers | None:
    """The model's markers: generation_config's "reasoning" entry, else the default
    markers when the tokenizer has both as single tokens, else None (it does not reason)."""
    declared = generation_config.get("reasoning")
    if isinstance(declared, dict):
        return ReasoningMarkers(declared.get("start", DEFAULT_START),
                                declared.get("end", DEFAULT_END), declared.get("bridge", ""))
    if DEFAULT_START in vocab and DEFAULT_END in vocab:
        return ReasoningMarkers()
    return None


def _hold_back(text: str, marker: str) -> str:
    """text without its longest tail that is a proper prefix of marker."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return text[:-length]
    return text


def split_reasoning(text: str, markers: ReasoningMarkers, open_at_start: bool = False,
                    finished: bool = True) -> tuple[str | None, str]:
    """(reasoning, content) of an output. reasoning is None when no thinking has begun;
    open_at_start: the prompt opened the thinking (a template that writes `<think>`).
    Leading whitespace of each part is dropped; while not finished, a possible partial
    marker at the end is held back (see the module docstring)."""
    if open_at_start:
        before, rest = "", text
    else:
        at = text.find(markers.start)
        if at < 0:
            return None, (text if finished else _hold_back(text, markers.start)).lstrip()
        before, rest = text[:at], text[at + len(markers.start):]
    end = rest.find(markers.end)
    if end < 0:
        reasoning = rest if finished else _hold_back(rest, markers.end)
        return reasoning.lstrip(), before.lstrip()
    return rest[:end].lstrip(), (before + rest[end + len(markers.end):]).lstrip()


def find_ids(haystack: Sequence[int], needle: Sequence[int], start: int = 0) -> int:
    """Index of the first occurrence of needle in haystack at or after start, or -1."""
    if not needle:
        return -1
    first, length = needle[0], len(needle)
    for index in range(start, len(haystack) - length + 1):
        if haystack[index] == first and list(haystack[index:index + length]) == list(needle):
            return index
    return -1


@dataclass(frozen=True)
class ThinkingTokens:
    """A request's view of its model's markers in token ids (the engine builds it once
    per request), plus what a thinking budget forces: bridge_ids, then end_ids."""

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    # The prompt ends inside an open thinking block: the output starts thinking.
    open_at_start: bool = False
    bridge_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ThinkingProgress:
    started: bool
    ended: bool
    # Output tokens after the start marker, up to the end marker (markers excluded).
    num_thinking_tokens: int


def thinking_progress(output_ids: Sequence[int], thinking: ThinkingTokens) -> ThinkingProgress:
    """Where the first thinking block of an output stands."""
    if thinking.open_at_start:
        begin = 0
    else:
        at = find_ids(output_ids, thinking.start_ids)
        if at < 0:
            return ThinkingProgress(False, False, 0)
        begin = at + len(thinking.start_ids)
    end = find_ids(output_ids, thinking.end_ids, begin)
    if end < 0:
        return ThinkingProgress(True, False, len(output_ids) - begin)
    return ThinkingProgress(True, True, end - begin)


def prompt_opens_thinking(prompt_ids: Sequence[int], thinking: ThinkingTokens) -> bool:
    """True when the prompt's last start marker has no end marker after it."""
    last_start = -1
    while (at := find_ids(prompt_ids, thinking.start_ids, last_start + 1)) >= 0:
        last_start = at
    if last_start < 0:
        return False
    return find_ids(prompt_ids, thinking.end_ids, last_start + len(thinking.start_ids)) < 0


def forced_sequence(thinking: ThinkingTokens, budget: int) -> tuple[int, ...]:
    """What a budget of `budget` thinking tokens ends with: the bridge then the end
    marker, or the end marker alone when the bridge does not fit in the budget."""
    with_bridge = thinking.bridge_ids + thinking.end_ids
    return with_bridge if len(thinking.bridge_ids) <= budget else thinking.end_ids
