"""Pipeline parallelism: stages of consecutive layers in worker processes give one
rank's greedy tokens and logprobs, with and without micro-batches and combined with
tensor parallelism; each stage holds only its layers."""

from __future__ import annotations

import pytest

from tokenmill import LLM
from tokenmill.dist.pipeline import PipelineStage, micro_batches
from tokenmill.engine.engine import LLMEngine

from .test_tensor_parallel import assert_same, generate


@pytest.mark.parametrize("family", ["llama", "llama_mqa_tied", "qwen2", "qwen3", "mixtral",
                                    "qwen2_moe", "qwen3_moe"])
def test_two_stages_give_one_ranks_tokens(model_factory, family):
    model_dir = model_factory(family)
    reference, _ = generate(model_dir)
    outputs, _ = generate(model_dir, pipeline_parallel_size=2)
    assert_same(reference, outputs)


@pytest.mark.parametrize("micro", [1, 3])
def test_micro_batches_do_not_change_the_tokens(llama_dir, micro):
    reference, _ = generate(llama_dir)
    outputs, _ = generate(llama_dir, pipeline_parallel_size=2, pipeline_micro_batches=micro)
    assert_same(reference, outputs)


def test_speculation_runs_through_the_pipeline(llama_dir):
    # The last stage verifies; every stage runs the same proposer on the same history.
    reference, _ = generate(llama_dir)
    outputs, _ = generate(llama_dir, pipeline_parallel_size=2, speculative_method="ngram")
    assert_same(reference, outputs)


def test_pipeline_and_tensor_parallel_combine(llama_dir):
    reference, _ = generate(llama_dir)
    outputs, engine = generate(llama_dir, pipeline_parallel_size=2, tensor_parallel_size=2,
                               sequence_parallel=True)
    assert_same(reference, outputs)
    assert len(engine.executor.rank_memory) == 4


def test_each_stage_holds_its_layers(llama_dir):
    single = LLMEngine.from_kwargs(str(llama_dir), progress=False, num_blocks=32)
    engine = LLMEngine.from_kwargs(str(llama_dir), progress=False, num_blocks=32,
                                   pipeline_parallel_size=2)
    try:
        first, last = engine.executor.rank_memory
        whole = single.info.memory
        assert first.kv_cache == last.kv_cache == whole.kv_cache // 2  # 1 of 2 layers each
        # The untied embedding and the LM head (the same size) sit on either end.
        assert first.weights == last.weights - single.info.arch.hidden_size * 4  # final norm
        assert first.weights + last.weights == whole.weights
    finally:
        engine.shutdown()
        single.shutdown()


def test_stages_split_layers_and_checkpoint_names():
    stages = [PipelineStage.of(i, 3, 8) for i in range(3)]
    assert [(s.start, s.end) for s in stages] == [(0, 2), (2, 5), (5, 8)]
    middle = stages[1]
    assert middle.local_name("model.layers.3.mlp.down_proj.weight", False) == \
        "model.layers.1.mlp.down_proj.weight"
    assert middle.local_name("model.layers.5.mlp.down_proj.weight", False) is None
    assert middle.local_name("model.embed_tokens.weight", False) is None
    assert stages[2].local_name("model.embed_tokens.weight", True) == "model.embed_tokens.weight"
    assert stages[2].local_name("model.embed_tokens.weight", False) is None
    assert stages[0].local_name("lm_head.weight", False) is None
    with pytest.raises(ValueError, match="pipeline_parallel_size 9"):
        PipelineStage.of(0, 9, 8)


def test_micro_batches_cut_contiguous_runs_of_about_equal_tokens():
    assert micro_batches([1] * 8, 2) == [range(0, 4), range(4, 8)]
    assert micro_batches([100, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert micro_batches([5], 3) == [range(0, 1)]
    assert micro_batches([1, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 3)]


def test_eagle_and_more_stages_than_layers_are_clear_errors(llama_dir):
    with pytest.raises(ValueError, match="speculative_method"):
        LLM(str(llama_dir), progress=False, pipeline_parallel_size=2,
            speculative_method="eagle", speculative_model=str(llama_dir))
    with pytest.raises(ValueError, match="pipeline_parallel_size 5"):
        LLM(str(llama_dir), progress=False, pipeline_parallel_size=5)
