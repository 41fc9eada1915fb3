"""Incremental text: multi-byte characters and stop strings that never leak."""

from __future__ import annotations

from transformers import AutoTokenizer

from tokenmill.core.request import Request
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.sampling_params import SamplingParams


def stream(tokenizer, text: str, params: SamplingParams):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    request = Request("r", [0], params, 0.0, 100)
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, request)
    visible = []
    stop = None
    for token in ids:
        stop = detok.add_token(request, token)
        visible.append(detok.visible_text(request))
        if stop:
            break
    return request, visible, stop


def test_multibyte_text_streams_exactly(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "façade — 日本語 🙂 done"
    request, visible, _ = stream(tokenizer, text, SamplingParams())
    assert request.output_text == text
    assert all("\ufffd" not in v for v in visible)
    assert all(a == b[:len(a)] for a, b in zip(visible, visible[1:], strict=False))  # only ever grows


def test_stop_string_is_cut_and_never_visible_in_the_stream(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "for i in range(10):\n    print(i)\nSTOP here"
    request, visible, stop = stream(tokenizer, text, SamplingParams(stop=["print(i)\nSTOP"]))
    assert stop == "print(i)\nSTOP"
    assert request.output_text == "for i in range(10):\n    "
    assert all("print(i)\nS" not in v for v in visible)
