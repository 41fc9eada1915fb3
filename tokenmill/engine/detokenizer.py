"""Incremental detokenisation and stop-string handling.

Text grows one token at a time through `tokenizers`' DecodeStream, which holds back
bytes until they form whole UTF-8 characters. Stop strings are searched only in the
region the new text could complete, and while a request runs, the tail that could
still be the start of a stop string is withheld from the visible text, so a stop
string never leaks into a stream.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from tokenmill.core.request import Request

# Prompt tokens given to a new stream as context (some decoders drop a leading space
# on the first token they see).
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, request: Request) -> None:
        self.tokenizer = tokenizer
        params = request.sampling_params
        self.stream = DecodeStream(ids=request.prompt_token_ids[-_CONTEXT_TOKENS:],
                                   skip_special_tokens=params.skip_special_tokens)
        self.stop = params.stop
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.include_stop = params.include_stop_str_in_output

    def add_token(self, request: Request, token_id: int, find_stop: bool = True) -> str | None:
        """Append a token's text; returns the stop string if one now appears (the text
        is then cut before it, or after it with include_stop_str_in_output)."""
        piece = self.stream.step(self.tokenizer, token_id)
        if not piece:
            return None
        previous_len = len(request.output_text)
        request.output_text += piece
        if not self.stop or not find_stop:
            return None
        # A stop string completed by this piece starts at most max_stop_len - 1 chars
        # before it.
        search_from = max(0, previous_len - self.max_stop_len + 1)
        text = request.output_text
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        request.output_text = text[:at + len(stop)] if self.include_stop else text[:at]
        return stop

    def visible_text(self, request: Request) -> str:
        """Text safe to show now: all of it once finished, else minus a possible stop prefix."""
        if request.is_finished or self.max_stop_len <= 1:
            return request.output_text
        return request.output_text[:max(0, len(request.output_text) - self.max_stop_len + 1)]
