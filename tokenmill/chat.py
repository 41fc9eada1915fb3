"""Text: a model's tokenizer, and chat prompts through its template, to token ids."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    """A model or tokenizer directory's tokenizer, or the one a GGUF file describes."""
    path = Path(source)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(source)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
                        add_generation_prompt: bool = True) -> list[int]:
    """Render a conversation with the model's template; ValueError if that is impossible."""
    if not messages:
        raise ValueError("messages must not be empty")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use a plain prompt instead")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)
    # The template writes any BOS itself, so the tokenizer must not add another.
    return tokenizer(text, add_special_tokens=False)["input_ids"]
