"""SamplingParams: how one request's tokens are chosen, with OpenAI/vLLM semantics."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# Temperatures below this are treated as greedy (0): dividing logits by them overflows
# float32 into infinities, which sampled garbage; greedy is their limit.
GREEDY_TEMPERATURE = 1e-5
# Integer fields the engine turns into int32/int64 tensors or list indices.
MAX_INT32 = 2**31 - 1
# OpenAI's range for a logit_bias value.
MAX_LOGIT_BIAS = 100.0


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    # temperature 0 means greedy decoding.
    temperature: float = 1.0
    top_p: float = 1.0
    # top_k <= 0 disables the filter (vLLM uses -1, OpenAI-style clients send 0).
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Number of top alternatives to return beside each sampled token (None: no logprobs).
    logprobs: int | None = None
    # Number of top alternatives for each prompt token (None: no prompt logprobs).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> value added to its logit before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # Reasoning models: most tokens the model may think for (between its markers); at
    # the budget the engine forces the bridge text and the end marker, so it answers.
    thinking_budget: int | None = None
    # Fewest thinking tokens: the end marker is suppressed until there are this many.
    min_thinking: int = 0
    # Text forced before the end marker when the budget is reached (None: the model's
    # declared bridge; "" ends the thinking at once).
    thinking_bridge: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.n, int) and 1 <= self.n <= 128, "n", "an integer in [1, 128]", self.n)
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
                   "an integer >= 1", self.max_tokens)
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", "<= max_tokens",
                   self.min_tokens)
        _check(isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0,
               "temperature", "in [0, 100]", self.temperature)
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and -1 <= self.top_k <= MAX_INT32, "top_k",
               f"an integer in [-1, {MAX_INT32}] (0 or -1 disables it)", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]",
               self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]",
               self.frequency_penalty)
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "in (0, 2]",
               self.repetition_penalty)
        if self.seed is not None:
            _check(isinstance(self.seed, int) and 0 <= self.seed < 2**63, "seed",
                   "an integer in [0, 2**63)", self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(isinstance(value, int) and 0 <= value <= MAX_LOGPROBS, name,
                       f"an integer in [0, {MAX_LOGPROBS}]", value)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "a list of non-empty strings", self.stop)
        _check(all(isinstance(t, int) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids),
               "stop_token_ids", "a list of token ids", self.stop_token_ids)
        if self.logit_bias is not None:
            self._check_logit_bias()
        self._check_thinking()

    def _check_thinking(self) -> None:
        def is_count(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT32

        if self.thinking_budget is not None:
            _check(is_count(self.thinking_budget), "thinking_budget",
                   f"an integer in [0, {MAX_INT32}] or None", self.thinking_budget)
        _check(is_count(self.min_thinking), "min_thinking", f"an integer in [0, {MAX_INT32}]",
               self.min_thinking)
        if self.thinking_budget is not None:
            _check(self.min_thinking <= self.thinking_budget, "min_thinking",
                   f"<= thinking_budget ({self.thinking_budget})", self.min_thinking)
        if self.thinking_bridge is not None:
            _check(isinstance(self.thinking_bridge, str), "thinking_bridge", "a string or None",
                   self.thinking_bridge)

    def _check_logit_bias(self) -> None:
        _check(isinstance(self.logit_bias, dict), "logit_bias",
               "a map of token ids to numbers", self.logit_bias)
        for token, bias in self.logit_bias.items():
            _check(isinstance(token, int) and 0 <= token <= MAX_INT32, "logit_bias",
                   "keyed by token ids", token)
            _check(isinstance(bias, (int, float)) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                   "logit_bias", f"values in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def controls_thinking(self) -> bool:
        """A thinking budget or minimum applies (to a reasoning model's output)."""
        return self.thinking_budget is not None or self.min_thinking > 0

    @property
    def reads_history(self) -> bool:
        """Whether a logits processor reads the request's tokens so far (the penalties,
        the thinking budget): the engine then sends them with every step."""
        return self.uses_penalties or self.controls_thinking
