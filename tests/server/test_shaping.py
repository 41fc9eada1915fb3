"""Stream deltas from cumulative engine outputs: a chunk for every step with new tokens."""

from __future__ import annotations

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.shaping import ChatShaper, CompletionShaper, PromptInput


class Serving:
    model_name = "m"
    reasons = False

    def token_text(self, token_id: int) -> str:
        return str(token_id)


# Three steps: a token whose bytes decode to no text yet, the one completing the
# character, then a last token that ends the completion.
STEPS = [([200], "", None), ([200, 201], "é", None), ([200, 201, 7], "éx", "length")]


def outputs():
    for token_ids, text, finish in STEPS:
        choice = CompletionOutput(index=0, text=text, token_ids=token_ids, finish_reason=finish)
        yield RequestOutput("r", "p", [1], [choice], finished=finish is not None)


def test_a_token_without_text_yet_streams_an_empty_completion_chunk():
    req = CompletionRequest(model="m", prompt="p", stream=True)
    shaper = CompletionShaper(Serving(), req, [PromptInput("p", [1])], echo_only=False)
    chunks = [c for out in outputs() for c in shaper.delta_chunks("r", 0, out)]
    assert [c.choices[0].text for c in chunks] == ["", "é", "x"]
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, "length"]


def test_a_token_without_text_yet_streams_an_empty_chat_delta():
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "p"}],
                                stream=True)
    shaper = ChatShaper(Serving(), req, [PromptInput(None, [1])])
    chunks = [c for out in outputs() for c in shaper.delta_chunks("r", 0, out)]
    assert [c.choices[0].delta.content for c in chunks] == ["", "é", "x"]
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, "length"]
