"""The offline API as a user calls it: prompts, params, outputs, errors."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), progress=False, block_size=8)


def test_text_prompts_return_text_tokens_and_timings(llm):
    outs = llm.generate(["def add(a, b):", "import os\n"], SamplingParams(temperature=0,
                                                                          max_tokens=12))
    assert [o.prompt for o in outs] == ["def add(a, b):", "import os\n"]
    for out in outs:
        completion = out.outputs[0]
        assert 1 <= len(completion.token_ids) <= 12
        assert completion.finish_reason in ("stop", "length")
        assert completion.text == llm.tokenizer.decode(completion.token_ids,
                                                       skip_special_tokens=True)
        metrics = completion.metrics
        assert metrics.queue_time >= 0 and metrics.time_to_first_token >= metrics.queue_time
        assert metrics.time_per_output_token >= 0


def test_one_params_per_prompt(llm):
    outs = llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(temperature=0, max_tokens=3,
                                                             ignore_eos=True),
                                              SamplingParams(temperature=0, max_tokens=5,
                                                             ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]


def test_stop_token_ids_and_stop_strings(llm):
    base = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20,
                                                    ignore_eos=True))[0].outputs[0]
    stop_id = base.token_ids[4]
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                   stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == base.token_ids[:base.token_ids.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    text = base.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if stop.strip() and len(stop) == 2:
        cut = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20,
                                                       ignore_eos=True, stop=[stop]))[0]
        assert cut.outputs[0].text == text[:text.index(stop)]
        assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop


def test_seeded_sampling_reproduces_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = llm.generate([[1, 2], [5, 6, 7], [9] * 30], [noisy, params, noisy])
    assert mixed[1].outputs[0].token_ids == alone


def test_n_completions_with_seed_differ_from_each_other(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    out = llm.generate([[5, 6, 7]], params)[0]
    assert len(out.outputs) == 3
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate([[5, 6, 7]], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_min_tokens_and_ignore_eos(llm):
    eos = next(iter(llm.engine.eos_token_ids))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10,
                                                   min_tokens=10))[0].outputs[0]
    assert len(out.token_ids) == 10 and eos not in out.token_ids


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0,
                                                                       max_tokens=4))[0]
    expected = llm.tokenizer("<|user|>hi\n<|assistant|>", add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids == expected


def test_logprobs_and_prompt_logprobs_shapes(llm):
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                      prompt_logprobs=1, ignore_eos=True))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 4
    assert [p.token_id for p in out.prompt_logprobs[1:]] == [6, 7, 8]
    completion = out.outputs[0]
    assert [lp.token_id for lp in completion.logprobs] == completion.token_ids
    assert all(len(lp.top) == 2 and lp.rank == 1 for lp in completion.logprobs)  # greedy
    assert completion.cumulative_logprob == pytest.approx(
        sum(lp.logprob for lp in completion.logprobs))


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-5), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(logprobs=50), "logprobs"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(stop=[""]), "stop"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(seed=-1), "seed"),
    (dict(top_k=2**63), "top_k"), (dict(stop_token_ids=[2**70]), "stop_token_ids"),
    (dict(logit_bias={3: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(temperature=float("nan")), "temperature"),
])
def test_out_of_range_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(block_size=3), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(chunk_policy="weird"), "chunk_policy"), (dict(dtype="int3"), "dtype"),
    (dict(kv_cache_memory_fraction=2.0), "kv_cache_memory_fraction"),
])
def test_bad_engine_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        EngineConfig.from_kwargs(**kwargs)


def test_unknown_engine_option_is_refused():
    with pytest.raises(ValueError, match="unknown engine option 'blok_size'"):
        EngineConfig.from_kwargs(blok_size=8)


def test_bad_prompts_raise_before_anything_is_queued(llm):
    engine = llm.engine
    too_long = [1] * engine.max_model_len
    with pytest.raises(ValueError, match="prompt is 512 tokens"):
        llm.generate([[1, 2], too_long], SamplingParams())
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="prompt token ids"):
        llm.generate([[10**6]], SamplingParams())
    # Malformed prompt shapes name the argument (they were TypeErrors, or silently []).
    for bad in (None, [], [1, 1.5], [[1, 2], None], 42):
        with pytest.raises(ValueError, match=r"^prompts"):
            llm.generate(bad, SamplingParams())
    with pytest.raises(ValueError, match="lone surrogate"):
        llm.generate("abc \ud800", SamplingParams())
    # As the server answers: the prompt and max_tokens must fit the context together.
    with pytest.raises(ValueError, match="^max_tokens"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=10**9))
    with pytest.raises(ValueError, match="^min_tokens"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=None, min_tokens=10**9))
    with pytest.raises(ValueError, match="^stop_token_ids"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[10**6]))
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_temperatures_below_the_floor_are_greedy(llm):
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8))
    tiny = llm.generate([[5, 6, 7]], SamplingParams(temperature=1e-40, max_tokens=8))
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    assert SamplingParams(temperature=1e-6).temperature == 0.0


def test_logit_bias_bans_and_forces_tokens(llm):
    prompt, params = [[5, 6, 7]], dict(temperature=0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(prompt, SamplingParams(**params))[0].outputs[0].token_ids
    banned = llm.generate(prompt, SamplingParams(**params, logit_bias={plain[0]: -100}))
    assert banned[0].outputs[0].token_ids[0] != plain[0]
    forced = llm.generate(prompt, SamplingParams(**params, logit_bias={9: 100}))
    assert forced[0].outputs[0].token_ids == [9] * 6


def test_unsupported_architecture_is_a_clear_error(tmp_path, llama_dir):
    import json
    import shutil

    target = tmp_path / "gpt"
    shutil.copytree(llama_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["GPTBigCodeForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'GPTBigCodeForCausalLM'"):
        LLM(str(target), progress=False)
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        LLM(str(tmp_path / "missing"), progress=False)


def test_abort_returns_blocks(llm):
    engine = llm.engine
    engine.add_request("to-abort", [5] * 40, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    out = engine.abort_request("to-abort")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    engine.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    assert not engine.has_unfinished_requests()


def test_the_server_names_the_model_by_its_directory_and_python_m_tokenmill_runs():
    import subprocess
    import sys

    from tokenmill.server.serve import served_model_id

    assert served_model_id(EngineConfig()) == "pycoder"
    assert served_model_id(EngineConfig(), "mine") == "mine"
    done = subprocess.run([sys.executable, "-m", "tokenmill", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "generate" in done.stdout
