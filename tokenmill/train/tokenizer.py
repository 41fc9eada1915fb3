"""Byte-level BPE tokenizer for Python source, saved in Hugging Face layout.

Byte-level BPE maps every byte to a symbol before merging, so any string (any
Unicode, tabs, CRLF, trailing spaces) encodes without an unknown token and
decodes back to exactly the same string.  No prefix space is added and the
``transformers`` wrapper is told not to clean up spaces, which would otherwise
break that round trip.  The one special token ``<|endoftext|>`` separates
documents and doubles as BOS, EOS and padding; no chat template is written
because these are completion models.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 8192
MODEL_MAX_LENGTH = 2048


def train_bpe(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = 2
) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``texts``.

    Training is deterministic for a fixed input order, which the corpus guarantees.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + {END_OF_TEXT}), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def wrap_for_transformers(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """The ``transformers`` view of ``tokenizer`` with the special tokens declared."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
    )


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    wrap_for_transformers(tokenizer).save_pretrained(str(out_dir))
    # Newer transformers releases fold this file into tokenizer_config.json; older
    # readers and other engines still look for it, so it is always written.
    special = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "pad_token": END_OF_TEXT}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    _normalise_config(out_dir)


def _normalise_config(out_dir: Path) -> None:
    """Name the portable tokenizer class and make sure no chat template is shipped.

    transformers 5 writes its internal ``TokenizersBackend`` class name, which older
    releases cannot resolve; ``PreTrainedTokenizerFast`` loads the same files in both.
    """
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)


def load_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """Load a saved tokenizer directory the way downstream users will."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def copy_tokenizer_files(src_dir: Path, out_dir: Path) -> None:
    """Copy the tokenizer files of ``src_dir`` next to a model in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out_dir / name).write_bytes((src_dir / name).read_bytes())
