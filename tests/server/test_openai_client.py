"""The official openai client against a real server: outputs match the offline LLM."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.server.conftest import MODEL_NAME
from tokenmill.cli import main
from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams

PROMPT = "def add(a, b):"
MESSAGES = [{"role": "user", "content": "Write a stack class."}]


@pytest.fixture(scope="module")
def offline(llama_dir) -> LLM:
    return LLM(str(llama_dir), progress=False)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0,
                         timeout=60)


@pytest.fixture
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key,
                              max_retries=0, timeout=60)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_greedy_completion_matches_offline_generate(client, offline):
    expected = offline.generate(PROMPT, greedy(12))[0].outputs[0]
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12,
                                         temperature=0)
    choice = response.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.prompt_tokens == len(offline.engine.encode(PROMPT))


def test_greedy_chat_matches_offline_chat(client, offline):
    expected = offline.chat(MESSAGES, greedy(10))[0].outputs[0]
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                              max_tokens=10, temperature=0)
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.completion_tokens == len(expected.token_ids)


def test_token_id_prompts_and_batches_match_offline(client, offline):
    prompts = ["import os", PROMPT]
    expected = [o.outputs[0].text for o in offline.generate(prompts, greedy(6))]
    response = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6,
                                         temperature=0, n=2)
    texts = {c.index: c.text for c in response.choices}
    assert texts == {0: expected[0], 1: expected[0], 2: expected[1], 3: expected[1]}
    id_prompts = [offline.engine.encode(p) for p in prompts]
    response = client.completions.create(model=MODEL_NAME, prompt=id_prompts, max_tokens=6,
                                         temperature=0)
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == expected
    response = client.completions.create(model=MODEL_NAME, prompt=id_prompts[1], max_tokens=6,
                                         temperature=0)
    assert response.choices[0].text == expected[1]


def test_streamed_completion_concatenates_to_the_full_text(server, offline, async_client):
    expected = offline.generate(PROMPT, greedy(16))[0].outputs[0]

    async def run():
        stream = await async_client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True})
        return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].choices == []


def test_stream_interval_sends_fewer_larger_chunks_of_the_same_text(server_factory, offline,
                                                                     llama_dir, capsys):
    server = server_factory("--stream-interval", "5")
    expected = offline.generate(PROMPT, greedy(16))[0].outputs[0]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0,
                           timeout=60)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    # Tokens 1, 6, 11 and 16 are delivered: at most four chunks carry text.
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == expected.text and len(pieces) <= 4
    assert chunks[-1].usage.completion_tokens == 16
    assert main(["serve", "--model", str(llama_dir), "--stream-interval", "0"]) == 2
    assert "--stream-interval must be >= 1" in capsys.readouterr().err


def test_streamed_chat_concatenates_to_the_full_text(offline, async_client):
    expected = offline.chat(MESSAGES, greedy(12))[0].outputs[0]

    async def run():
        stream = await async_client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True})
        return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_sync_streaming_chat_with_n(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                            n=3, temperature=1.0, seed=3, stream=True)
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in stream
                if c.choices and c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length", 2: "length"}


def test_n_completions_are_indexed_and_counted(client):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, n=3,
                                         temperature=1.0, seed=7)
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert response.usage.completion_tokens == 15


def test_stop_string_cuts_the_text_and_never_streams(client, offline):
    full = offline.generate(PROMPT, greedy(16))[0].outputs[0].text
    stop = full[4:6]
    assert stop.strip(), f"generated text too short to pick a stop string: {full!r}"
    expected = full[:full.find(stop)]
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                         temperature=0, stop=[stop])
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True))
    assert streamed == expected


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12,
                                          temperature=1.0, seed=seed).choices[0].text

    assert sample(1234) == sample(1234)


def test_completion_logprobs_have_the_legacy_shape(client):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6,
                                         temperature=0, logprobs=2)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value == pytest.approx(max(top.values()), abs=1e-5)
        assert token in top
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_logprobs_score_the_prompt_like_generation(client, offline):
    """lm-eval-harness loglikelihood: echo + logprobs + max_tokens=0 scores a prompt; the
    scores of a greedy continuation must equal the logprobs it was generated with."""
    ids = offline.engine.encode(PROMPT)
    generated = offline.generate(ids, greedy(4, logprobs=0))[0].outputs[0]
    scored = client.completions.create(model=MODEL_NAME, prompt=ids + generated.token_ids,
                                       max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = scored.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    tail = lp.token_logprobs[-4:]
    assert tail == pytest.approx([t.logprob for t in generated.logprobs], abs=1e-4)
    assert scored.usage.completion_tokens == 0
    assert choice.text == offline.tokenizer.decode(ids + generated.token_ids)


def test_prompt_logprobs_are_vllms_and_the_offline_engines(client, offline):
    """vLLM's prompt_logprobs extension: per prompt token (the first null), the token's
    logprob and rank and the top N, keyed by token id; equal to the offline engine's."""
    ids = offline.engine.encode(PROMPT + " return a + b")
    expected = offline.generate(ids, greedy(1, prompt_logprobs=2))[0].prompt_logprobs
    response = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1,
                                         temperature=0, extra_body={"prompt_logprobs": 2})
    shaped = response.choices[0].model_extra["prompt_logprobs"]
    assert len(shaped) == len(ids) and shaped[0] is None and expected[0] is None
    for token_id, entry, reference in zip(ids[1:], shaped[1:], expected[1:], strict=True):
        assert entry[str(token_id)]["logprob"] == pytest.approx(reference.logprob, abs=1e-4)
        assert entry[str(token_id)]["rank"] == reference.rank
        top = sorted(((v["rank"], int(k)) for k, v in entry.items() if v["rank"] <= 2))
        assert [t for _rank, t in top] == [t for t, _lp in reference.top]
        assert all(v["decoded_token"] == offline.tokenizer.decode([int(k)])
                   for k, v in entry.items())
    # Echo's alternatives stay as many as logprobs asks, whatever prompt_logprobs asks.
    both = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True,
                                     logprobs=1, temperature=0,
                                     extra_body={"prompt_logprobs": 3})
    assert all(len(top) <= 2 for top in both.choices[0].logprobs.top_logprobs[1:])
    assert len(both.choices[0].model_extra["prompt_logprobs"][1]) >= 3


def test_echo_prepends_the_prompt(client, offline):
    expected = offline.generate(PROMPT, greedy(5))[0].outputs[0].text
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5,
                                         temperature=0, echo=True)
    assert response.choices[0].text == PROMPT + expected


def test_chat_logprobs(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                              temperature=0, logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
               for entry in content)


def test_min_tokens_ignore_eos_and_stop_token_ids(client, offline):
    full = offline.generate(PROMPT, greedy(8))[0].outputs[0]
    stop_id = full.token_ids[3]
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
        extra_body={"stop_token_ids": [stop_id], "min_tokens": 1, "ignore_eos": True})
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == full.token_ids.index(stop_id) + 1


def test_tokenize_and_detokenize_round_trip(server, offline):
    import httpx

    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT},
                        headers=server.auth_headers).json()
    assert tokens["tokens"] == offline.engine.encode(PROMPT)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]},
                      headers=server.auth_headers).json()
    assert text["prompt"] == PROMPT
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES},
                      headers=server.auth_headers).json()
    assert chat["tokens"] == offline.apply_chat_template(MESSAGES)
