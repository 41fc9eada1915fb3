"""Tiny random-initialised checkpoints of each supported family, built with transformers."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

TOKENIZER_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "for i in range(10):\n    print(i, 'hello world')\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé façade — 日本語 🙂\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

VOCAB_SIZE = 384


def build_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


THINK_START, THINK_END = "<think>", "</think>"


def build_thinking_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """The test tokenizer's twin with `<think>` and `</think>` as its last two tokens
    (added, not special: they decode as text, as Qwen3's do), same vocabulary size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - 2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
    tok.add_tokens([AddedToken(THINK_START, normalized=False, special=False),
                    AddedToken(THINK_END, normalized=False, special=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)
    # DeepSeek-R1's way: the generation prompt opens the thinking.
    fast.chat_template = CHAT_TEMPLATE.replace("<|assistant|>", "<|assistant|><think>")
    fast.save_pretrained(out_dir)
    return fast


def _common(**overrides) -> dict:
    cfg = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, initializer_range=0.1, bos_token_id=0,
               eos_token_id=0, pad_token_id=0)
    cfg.update(overrides)
    return cfg


FAMILIES = {
    "llama": lambda: LlamaConfig(**_common()),
    "llama3_rope": lambda: LlamaConfig(**_common(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rope_theta=500000.0)),
    "llama_mqa_tied": lambda: LlamaConfig(**_common(num_key_value_heads=1,
                                                    tie_word_embeddings=True)),
    "mistral": lambda: MistralConfig(**_common(sliding_window=None)),
    "qwen2": lambda: Qwen2Config(**_common(tie_word_embeddings=True)),
    "qwen3": lambda: Qwen3Config(**_common(head_dim=32)),
    "mixtral": lambda: MixtralConfig(**_common(num_local_experts=4, num_experts_per_tok=2,
                                               sliding_window=None)),
    # A shared expert, unnormalised top-k weights, and a dense first layer.
    "qwen2_moe": lambda: Qwen2MoeConfig(**_common(
        tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, norm_topk_prob=False,
        mlp_only_layers=[0])),
    "qwen3_moe": lambda: Qwen3MoeConfig(**_common(
        head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True)),
}


def build_model(family: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = FAMILIES[family]()
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir
