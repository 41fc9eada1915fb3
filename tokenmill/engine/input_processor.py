"""Prompts into token ids, checked against the model and the KV pool, from any thread.

The engine is owned by one thread (the async engine's loop), but tokenizing a long
prompt takes milliseconds to seconds, and the server must not do it on its event
loop or on the engine's thread. An InputProcessor holds only immutable limits and
the tokenizer, whose encoding (a Hugging Face fast tokenizer mutates its truncation
and padding state while encoding) runs under a lock: it is safe to call from a pool
of threads, while the engine keeps stepping.
"""

from __future__ import annotations

import threading

from transformers import PreTrainedTokenizerBase

from tokenmill.chat import apply_chat_template
from tokenmill.reasoning import ReasoningMarkers, ThinkingTokens, prompt_opens_thinking
from tokenmill.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_model_len: int,
                 num_blocks: int, block_size: int,
                 reasoning: ReasoningMarkers | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._lock = threading.Lock()
        # A reasoning model's markers, as text and as the token ids it writes them with.
        self.reasoning = reasoning
        self._markers = None if reasoning is None else ThinkingTokens(
            tuple(self.encode(reasoning.start, add_special_tokens=False)),
            tuple(self.encode(reasoning.end, add_special_tokens=False)))

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        check_text(prompt, "prompt")
        with self._lock:
            return self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]

    def chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True
             ) -> list[int]:
        """A conversation through the model's chat template (ValueError if impossible)."""
        for message in messages:
            check_text(message.get("content") or "", "messages")
        with self._lock:
            return apply_chat_template(self.tokenizer, messages, add_generation_prompt)

    def thinking_tokens(self, prompt_ids: list[int], params: SamplingParams
                        ) -> ThinkingTokens | None:
        """A request's markers in token ids (None for a model that does not reason): the
        bridge its budget forces, and whether its prompt leaves the thinking open."""
        if self._markers is None:
            return None
        bridge = params.thinking_bridge
        if bridge is None:
            bridge = self.reasoning.bridge
        bridge_ids: tuple[int, ...] = ()
        if bridge:
            check_text(bridge, "thinking_bridge")
            with self._lock:
                bridge_ids = tuple(self.tokenizer(bridge, add_special_tokens=False)["input_ids"])
        return ThinkingTokens(self._markers.start_ids, self._markers.end_ids,
                              prompt_opens_thinking(prompt_ids, self._markers), bridge_ids)

    def decode(self, token_ids: list[int]) -> str:
        with self._lock:
            return self.tokenizer.decode(token_ids)

    def validate(self, token_ids: list[int], params: SamplingParams) -> int:
        """Check a prompt against the model and pool; returns the effective max_tokens."""
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens; it must be shorter than the "
                             f"model's context of {self.max_model_len} tokens")
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            # As the OpenAI server answers (400): the prompt and the tokens asked for
            # must fit the context together.
            raise ValueError(f"max_tokens: the prompt ({len(token_ids)} tokens) and max_tokens "
                             f"({params.max_tokens}) exceed the model's context of "
                             f"{self.max_model_len} tokens")
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if params.controls_thinking and self.reasoning is None:
            field = "thinking_budget" if params.thinking_budget is not None else "min_thinking"
            raise ValueError(f"{field}: this model does not reason (it declares no thinking "
                             "markers in generation_config.json and its tokenizer has no "
                             "<think> and </think> tokens)")
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) must be at most the tokens "
                             f"the context leaves for this prompt ({max_tokens})")
        vocab_ids = [*params.stop_token_ids, *(params.logit_bias or {})]
        if any(t >= vocab for t in vocab_ids):
            field = ("stop_token_ids" if any(t >= vocab for t in params.stop_token_ids)
                     else "logit_bias")
            raise ValueError(f"{field}: token ids must be in [0, {vocab})")
        need = -(-(len(token_ids) + max_tokens) // self.block_size)
        if need > self.num_blocks:
            raise ValueError(
                f"max_tokens: prompt ({len(token_ids)}) + max_tokens ({max_tokens}) needs {need} "
                f"KV blocks but the pool has {self.num_blocks}; lower max_tokens "
                "or give the KV cache more memory")
        return max_tokens

    def process(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, validated (raises ValueError naming what is wrong)."""
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(token_ids, params)
        return token_ids


def check_text(text: str, field: str) -> None:
    """ValueError naming `field` unless `text` is a string of valid Unicode (a lone
    surrogate such as JSON's "\\ud800" has no UTF-8 encoding and no tokens)."""
    if not isinstance(text, str):
        raise ValueError(f"{field} must be a string or token ids, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field} contains {text[exc.start:exc.end]!r} at character "
                         f"{exc.start}, a lone surrogate, which is not valid Unicode text") from None
