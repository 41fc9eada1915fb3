"""Offline API: LLM(model, **engine options).generate(prompts, params) and .chat(messages)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from tokenmill.chat import apply_chat_template
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, progress: bool = True, **engine_options: Any):
        if model is not None:
            engine_options["model"] = str(model)
        self.config = EngineConfig.from_kwargs(**engine_options)
        self.engine = LLMEngine(self.config, progress=progress)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is a string or a list of token ids; params is one SamplingParams for
        all prompts or one per prompt. Every request is validated before any is queued.
        """
        batch = _as_prompt_list(prompts)
        if params is None:
            params = SamplingParams()
        param_list = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(batch):
            raise ValueError(f"params: got {len(param_list)} SamplingParams for "
                             f"{len(batch)} prompts")
        encoded = [self.engine.encode(p) if isinstance(p, str) else list(p) for p in batch]
        for token_ids, p in zip(encoded, param_list, strict=True):
            self.engine.validate_prompt(token_ids, p)
        ids = []
        for prompt, token_ids, p in zip(batch, encoded, param_list, strict=True):
            request_id = f"llm-{self._counter}"
            self._counter += 1
            self.engine.add_request(request_id, token_ids, p)
            if isinstance(prompt, str):
                self.engine.groups[request_id].prompt = prompt
            ids.append(request_id)
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        final[output.request_id] = output
                        bar.update(1)
        return [final[i] for i in ids]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, params, use_tqdm)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """The prompts as a list: a string, a list of token ids, or a list of either.
    ValueError (naming `prompts`) for anything else."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty string, a list of token ids, or a "
                         f"non-empty list of those; got {prompts!r:.80}")
    if all(_is_token_id(t) for t in prompts):
        return [list(prompts)]
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str) and not (
                isinstance(prompt, Sequence) and all(_is_token_id(t) for t in prompt)):
            raise ValueError(f"prompts[{index}] must be a string or a list of token ids "
                             f"(integers), got {prompt!r:.80}")
    return list(prompts)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
