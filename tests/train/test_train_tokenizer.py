"""The byte-level BPE tokenizer round-trips any Python source exactly."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tests.train.conftest import committed_model_dir
from tokenmill.train.tokenizer import END_OF_TEXT

AWKWARD_SOURCES = (
    "def f(x):\n    return x\n",
    "café = 'é'\nname = \"日本語\"  # комментарий\n",
    "emoji = '🐍🚀'  \n\n\n",
    "\tindented_with_tab = 1\t\n  \t mixed = 2   \n",
    "windows_line = 1\r\nnext_line = 2\r\n",
    "   leading spaces\n",
    "x = 1 ;  y=2  ,z\n\n\n\n        \n",
    "s = '\\x00\\u200b zero width\u200b'\n",
    "<|endoftext|> literal in text",
    "",
    " ",
    "a" * 300 + " " * 17 + "\n",
)


def assert_round_trips(tokenizer: PreTrainedTokenizerFast) -> None:
    for source in AWKWARD_SOURCES:
        ids = tokenizer(source)["input_ids"]
        assert tokenizer.decode(ids) == source, repr(source)


def test_tokenizer_trained_on_a_few_kb_round_trips_awkward_source(tiny_tokenizer_dir):
    assert_round_trips(AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)))


def test_committed_tokenizer_round_trips_awkward_source():
    model_dir = committed_model_dir("pycoder")
    assert_round_trips(AutoTokenizer.from_pretrained(str(model_dir)))


def test_end_of_text_is_bos_eos_and_pad(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    end_of_text_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == tokenizer.pad_token_id
    assert tokenizer.eos_token_id == end_of_text_id
    # No BOS/EOS is added on encode: prompts tokenise to exactly their own text.
    assert tokenizer("x = 1")["input_ids"] == tokenizer.backend_tokenizer.encode("x = 1").ids


def test_saved_config_has_no_chat_template_and_keeps_spaces(tiny_tokenizer_dir):
    config = json.loads((tiny_tokenizer_dir / "tokenizer_config.json").read_text())
    assert "chat_template" not in config
    assert config["clean_up_tokenization_spaces"] is False
    assert not (tiny_tokenizer_dir / "chat_template.jinja").exists()
    assert (tiny_tokenizer_dir / "special_tokens_map.json").is_file()


@pytest.mark.parametrize("vocab_size", [0, 256])
def test_vocab_too_small_for_bytes_is_rejected(vocab_size):
    from tokenmill.train.tokenizer import train_bpe

    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(["x = 1\n"], vocab_size=vocab_size)
