"""Tensor parallelism over worker processes: the same greedy tokens as one rank, logits
within float32 reassociation, each rank holding its shard, and a clear error when a
rank dies or the model does not split."""

from __future__ import annotations

import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine import LLMEngine
from tokenmill.executor.base import WorkerDiedError
from tokenmill.layers import native_linear

PROMPTS = [[5, 17, 42, 99, 3], list(range(20, 61)), [7, 7, 7], [300, 12]]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3,
                        prompt_logprobs=1)
# Summation order differs between one rank and two (partial sums, then the reduction).
LOGPROB_TOLERANCE = 1e-4


def generate(model_dir, **options):
    llm = LLM(str(model_dir), progress=False, **options)
    try:
        return llm.generate(PROMPTS, PARAMS), llm.engine
    finally:
        llm.engine.shutdown()


def assert_same(reference, outputs) -> None:
    for ref, out in zip(reference, outputs, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        pairs = [(a.logprob, b.logprob) for a, b in zip(ref.outputs[0].logprobs,
                                                         out.outputs[0].logprobs, strict=True)]
        pairs += [(a.logprob, b.logprob) for a, b in zip(ref.prompt_logprobs[1:],
                                                         out.prompt_logprobs[1:], strict=True)]
        assert max(abs(a - b) for a, b in pairs) < LOGPROB_TOLERANCE


# llama_mqa_tied: one KV head for two ranks (replicated) and a tied, vocab-split LM head
# that doubles as the embedding; qwen2: split q/k/v biases; mixtral: experts split by
# columns and rows, reduced once per layer.
@pytest.mark.parametrize("family", ["llama", "llama_mqa_tied", "qwen2", "qwen3", "mixtral",
                                    "qwen2_moe", "qwen3_moe"])
def test_two_ranks_give_one_ranks_tokens(model_factory, family):
    model_dir = model_factory(family)
    reference, _ = generate(model_dir)
    outputs, engine = generate(model_dir, tensor_parallel_size=2)
    assert_same(reference, outputs)
    one, two = engine.executor.rank_memory
    assert one.weights == two.weights and one.kv_cache == two.kv_cache


@pytest.mark.skipif(not native_linear.available(), reason="no C++ compiler")
def test_a_vocab_split_tied_head_embeds_from_its_native_packed_shard(model_factory):
    """Native products keep only the packed copy of a tied head: each rank's embedding
    gathers its vocabulary share's rows out of the packed blocks."""
    model_dir = model_factory("llama_mqa_tied")
    reference, _ = generate(model_dir, cpu_blas="native")
    outputs, _ = generate(model_dir, tensor_parallel_size=2, cpu_blas="native")
    assert_same(reference, outputs)


# Sequence parallelism moves the norms and residual adds onto each rank's share of the
# tokens; the sums are the same (a reduce-scatter instead of an all-reduce), so are the
# tokens. Steps with fewer tokens than ranks (decode of one sequence) pad a share.
@pytest.mark.parametrize("family", ["llama", "llama_mqa_tied", "qwen2", "qwen3", "mixtral",
                                    "qwen2_moe", "qwen3_moe"])
def test_sequence_parallel_gives_one_ranks_tokens(model_factory, family):
    model_dir = model_factory(family)
    reference, _ = generate(model_dir)
    outputs, _ = generate(model_dir, tensor_parallel_size=2, sequence_parallel=True)
    assert_same(reference, outputs)


# Expert parallelism: each rank holds half the experts, whole. Without SP the tokens are
# on every rank and the partial outputs are summed; with SP each rank's tokens travel to
# their experts and back by all-to-all.
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_expert_parallel_gives_one_ranks_tokens(model_factory, family, sequence_parallel):
    model_dir = model_factory(family)
    reference, single = generate(model_dir)
    outputs, engine = generate(model_dir, tensor_parallel_size=2, expert_parallel=True,
                               sequence_parallel=sequence_parallel)
    assert_same(reference, outputs)
    # Every routed token counted once, whichever rank routed it.
    assert engine.expert_load.totals == single.expert_load.totals


def test_expert_parallel_ranks_hold_half_the_experts(model_factory):
    model_dir = model_factory("mixtral")
    tp = LLMEngine.from_kwargs(str(model_dir), progress=False, num_blocks=32,
                               tensor_parallel_size=2)
    ep = LLMEngine.from_kwargs(str(model_dir), progress=False, num_blocks=32,
                               tensor_parallel_size=2, expert_parallel=True)
    try:
        # Attention is split alike; the experts' bytes are halved either way.
        assert ep.executor.rank_memory[0].weights == tp.executor.rank_memory[0].weights
    finally:
        tp.shutdown()
        ep.shutdown()
    with pytest.raises(ValueError, match="expert_parallel"):
        LLM(str(model_dir), progress=False, expert_parallel=True)
    with pytest.raises(ValueError, match="expert_parallel needs a mixture of experts"):
        LLM(str(model_factory("llama")), progress=False, tensor_parallel_size=2,
            expert_parallel=True)


def test_sequence_parallel_needs_tensor_parallel_ranks(llama_dir):
    with pytest.raises(ValueError, match="sequence_parallel"):
        LLM(str(llama_dir), progress=False, sequence_parallel=True)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "rhd"])
def test_tokenmills_own_all_reduce_serves_too(llama_dir, algorithm):
    reference, _ = generate(llama_dir)
    outputs, _ = generate(llama_dir, tensor_parallel_size=2, all_reduce=algorithm)
    assert_same(reference, outputs)


def test_each_rank_holds_about_half_the_weights_and_kv(llama_dir):
    single = LLMEngine.from_kwargs(str(llama_dir), progress=False, num_blocks=32)
    engine = LLMEngine.from_kwargs(str(llama_dir), progress=False, num_blocks=32,
                                   tensor_parallel_size=2)
    try:
        rank = engine.executor.rank_memory[0]
        whole = single.info.memory
        assert rank.kv_cache == whole.kv_cache // 2  # 2 KV heads: one per rank
        # Norms are replicated; every projection and the embedding are split.
        assert whole.weights / 2 <= rank.weights < 0.55 * whole.weights
    finally:
        engine.shutdown()


def test_a_model_that_does_not_split_is_a_clear_error(llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        LLM(str(llama_dir), progress=False, tensor_parallel_size=3)


def test_a_rank_dying_mid_run_fails_the_engine_quickly(llama_dir):
    engine = LLMEngine.from_kwargs(str(llama_dir), progress=False, tensor_parallel_size=2)
    engine.add_request("a", PROMPTS[1], PARAMS)
    engine.step()
    engine.executor._processes[1].kill()
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="exited"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_shard_across_ranks(llama_dir, quantization):
    # Each rank quantizes its shard. With groups smaller than a row shard's inputs,
    # column shards keep their rows' scales and row shards whole groups, so two ranks
    # hold exactly the single rank's quantized values; only the summation order moves.
    options = {"quantization": quantization, "quantization_group_size": 32}
    reference, _ = generate(llama_dir, **options)
    outputs, _ = generate(llama_dir, tensor_parallel_size=2, **options)
    assert_same(reference, outputs)
