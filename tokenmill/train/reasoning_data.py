"""The reasoning model's data: its tokenizer (digits one by one, chat roles and the
thinking markers as single tokens, a chat template) and its training texts.

Digits are split one per token so arithmetic is done digit by digit, as in Llama 3
and Qwen tokenizers. `<|user|>` and `<|assistant|>` are special tokens (dropped from
decoded text); `<think>` and `</think>` are added tokens that are *not* special, so
they stay in the decoded text, where tokenmill's reasoning parser finds them (as
Qwen3's and DeepSeek-R1's tokenizers do). The model declares that it reasons in its
generation_config.json (the preset's `generation_config` entry).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from tokenmill.train.reasoning_tasks import (
    ASSISTANT,
    THINK_END,
    THINK_START,
    USER,
    generate_items,
)
from tokenmill.train.tokenizer import END_OF_TEXT, MODEL_MAX_LENGTH, wrap_for_transformers

REASONING_VOCAB_SIZE = 320
TOKENIZER_ITEMS = 4000
# The chat format the model is trained on: each message is `<|role|>\n` + content + `\n`;
# the generation prompt is `<|assistant|>\n`, after which the model writes `<think>`.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# Held-out items come from their own seed, far from any training seed.
HELD_OUT_SEED = 1_000_003


def train_reasoning_tokenizer(texts: list[str], vocab_size: int = REASONING_VOCAB_SIZE
                              ) -> Tokenizer:
    """Byte-level BPE over `texts` with single-digit tokens, the roles as special tokens
    and the thinking markers as plain added tokens (the last two ids)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2, min_frequency=2,
        special_tokens=[END_OF_TEXT, USER, ASSISTANT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # The markers become whole tokens below; their letters should not spend merges.
    plain = [t.replace(THINK_START, "").replace(THINK_END, "") for t in texts]
    tokenizer.train_from_iterator(plain, trainer=trainer)
    tokenizer.add_tokens([AddedToken(THINK_START, normalized=False, special=False),
                          AddedToken(THINK_END, normalized=False, special=False)])
    return tokenizer


def save_reasoning_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and the special
    tokens map, loadable by transformers' AutoTokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    wrap_for_transformers(tokenizer).save_pretrained(str(out_dir))
    special = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "pad_token": END_OF_TEXT,
               "additional_special_tokens": [USER, ASSISTANT]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config["model_max_length"] = MODEL_MAX_LENGTH
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # One place for the template: tokenizer_config.json (copied beside the model).
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)


def reasoning_texts(seed: int, count: int) -> list[str]:
    """`count` conversations (prompt, thinking, answer) as the model is trained on them."""
    return [item.chat_text() for item in generate_items(seed, count)]


def reasoning_corpus(extra: dict, seed: int) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts) for a preset whose data is "reasoning"."""
    return (reasoning_texts(seed, extra["train_items"]),
            reasoning_texts(HELD_OUT_SEED, extra["held_out_items"]))


def build_reasoning_tokenizer(out_dir: Path) -> Tokenizer:
    """Train on a fixed sample of items (seed 0) and save to out_dir."""
    tokenizer = train_reasoning_tokenizer(reasoning_texts(0, TOKENIZER_ITEMS))
    save_reasoning_tokenizer(tokenizer, out_dir)
    return tokenizer
