"""A quantized model runs through the engine exactly as the same model with its
dequantized weights as plain float32 (the kernels' exactness, not quantization's):
greedy tokens identical, dense and MoE, tied and untied LM heads."""

from __future__ import annotations

import pytest
import torch

from tests.engine_run import run_staggered
from tests.models import TOKENIZER_CORPUS
from tokenmill import SamplingParams
from tokenmill.engine.engine import LLMEngine
from tokenmill.layers import native_linear
from tokenmill.layers.linear import Linear
from tokenmill.quant.methods import QuantizedLinearMethod

PROMPTS = [[5, 17, 42, 99, 3, 8, 1, 2, 3, 4, 5, 6, 7], list(range(20, 61)), [7, 7, 7], [300, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def run(model_dir, **options) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine.from_kwargs(str(model_dir), progress=False, block_size=8,
                                   max_num_batched_tokens=24, **options)
    return run_staggered(engine, PROMPTS, GREEDY, arrivals=[0, 1, 1, 4]), engine


def linear_layers(engine: LLMEngine) -> dict[str, Linear]:
    model = engine.executor.worker.runner.model
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def dequantized_reference(model_dir, quantized: LLMEngine) -> LLMEngine:
    """The same checkpoint on torch's plain float32 products, every quantized layer's
    weight replaced by what its codes stand for."""
    engine = LLMEngine.from_kwargs(str(model_dir), progress=False, block_size=8,
                                   max_num_batched_tokens=24, cpu_blas="torch")
    reference = linear_layers(engine)
    for name, layer in linear_layers(quantized).items():
        if isinstance(layer.method, QuantizedLinearMethod):
            target = reference[name]
            target.method.load_weight(target, layer.checkpoint_weight(),
                                      slice(0, target.out_features))
    return engine


CASES = [
    ("llama", {"quantization": "int8"}),
    ("llama", {"quantization": "int4", "quantization_group_size": 32}),
    ("llama_mqa_tied", {"quantization": "int4", "quantization_group_size": 32,
                        "quantization_method": "hqq"}),
    ("llama_mqa_tied", {"quantization": "int8", "quantization_group_size": 32,
                        "cpu_blas": "torch"}),
    ("mixtral", {"quantization": "int4", "quantization_group_size": 64}),
    ("mixtral", {"quantization": "int8", "quantization_exclude": "lm_head"}),
    ("llama_mqa_tied", {"quantization": "int4", "quantization_group_size": 32,
                        "quantization_method": "awq"}),
    ("mixtral", {"quantization": "int4", "quantization_group_size": 32,
                 "quantization_method": "awq"}),
]


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    """Text in the tiny models' tokenizer's domain (never the prompts below)."""
    path = tmp_path_factory.mktemp("calibration") / "calibration.txt"
    path.write_text("".join(TOKENIZER_CORPUS) * 4)
    return path


@pytest.mark.parametrize("family, options", CASES)
def test_quantized_model_generates_what_its_dequantized_weights_generate(
        model_factory, calibration_file, family, options):
    if options.get("quantization_method") == "awq":
        options = {**options, "quantization_calibration": str(calibration_file)}
    model_dir = model_factory(family)
    tokens, engine = run(model_dir, **options)
    reference = dequantized_reference(model_dir, engine)
    expected = run_staggered(reference, PROMPTS, GREEDY, arrivals=[0, 1, 1, 4])
    assert tokens == expected
    layers = linear_layers(engine)
    quantized = {n for n, m in layers.items() if isinstance(m.method, QuantizedLinearMethod)}
    routers = {n for n in layers if n.endswith(".mlp.gate")}
    excluded = {"lm_head"} if options.get("quantization_exclude") else set()
    assert quantized == set(layers) - routers - excluded
    # Every quantized layer keeps no float weight beside its codes.
    assert all(layers[n].weight.numel() == 0 for n in quantized)


def prompt_logprobs(model_dir, **options) -> list[float]:
    engine = LLMEngine.from_kwargs(str(model_dir), progress=False, **options)
    engine.add_request("p", PROMPTS[1], SamplingParams(temperature=0, max_tokens=1,
                                                      prompt_logprobs=0))
    output = engine.run_to_completion()["p"]
    return [entry.logprob for entry in output.prompt_logprobs if entry is not None]


def test_int8_moves_the_log_probabilities_less_than_int4(model_factory):
    """Quantization error reaches the output in proportion to the weights' error: the
    prompt's log-probabilities move by little under int8, by more under int4."""
    model_dir = model_factory("llama")
    full = prompt_logprobs(model_dir)

    def drift(**options) -> float:
        quantized = prompt_logprobs(model_dir, **options)
        return max(abs(a - b) for a, b in zip(full, quantized, strict=True))

    int8 = drift(quantization="int8")
    int4 = drift(quantization="int4", quantization_group_size=32)
    # int8's steps are ~10x finer than int4's (measured 0.06 and 0.56 nats here).
    assert 0 < int8 < 0.15 and 4 * int8 < int4 < 2.0


def test_layers_the_group_size_does_not_divide_keep_float_weights(llama_dir, caplog):
    """The tiny llama's hidden size is 64: group 128 fits only down_proj (128 inputs)."""
    with caplog.at_level("WARNING", logger="tokenmill.quant.policy"):
        _, engine = run(llama_dir, quantization="int4")
    quantized = {n for n, m in linear_layers(engine).items()
                 if isinstance(m.method, QuantizedLinearMethod)}
    assert quantized == {f"model.layers.{i}.mlp.down_proj" for i in range(2)}
    warnings = [r.getMessage() for r in caplog.records if "keep float weights" in r.getMessage()]
    assert len(warnings) == 1 and "64 input columns" in warnings[0]


@pytest.mark.parametrize("cpu_blas, options, native_builds, expected", [
    ("numpy", {"quantization": "int8"}, True, 2), ("numpy", {}, True, 1),
    ("native", {"quantization": "int8"}, True, 2),
    ("numpy", {"quantization": "int8", "quantization_exclude": "lm_head"}, True, 2),
    ("numpy", {"quantization": "int8", "quantization_exclude": "lm_head"}, False, 1)])
def test_quantized_kernels_keep_torchs_threads_in_a_step(llama_dir, monkeypatch, cpu_blas,
                                                          options, native_builds, expected):
    """A NumPy base confines torch to one thread in a step (its BLAS has the cores); the
    quantized kernels run on torch's pool, so a quantized model keeps both threads
    (they ran int8 decode on one core before): its float layers (an excluded head)
    take the native kernel, on torch's pool too. Where that kernel cannot be built
    they stay on OpenBLAS and the step stays confined (unconfined, the two pools'
    spinning threads measured slower)."""
    if cpu_blas == "native" or native_builds:
        if not native_linear.available():
            pytest.skip("no C++ compiler")
    else:
        monkeypatch.setattr(native_linear, "available", lambda: False)
    seen: list[int] = []
    original = Linear.forward

    def recording(self, x):
        seen.append(torch.get_num_threads())
        return original(self, x)

    monkeypatch.setattr(Linear, "forward", recording)
    engine = LLMEngine.from_kwargs(str(llama_dir), progress=False, num_threads=2,
                                   cpu_blas=cpu_blas, **options)
    if "quantization_exclude" in options:
        head = linear_layers(engine)["lm_head"].method.name
        assert head == ("native" if native_builds else "numpy-transposed")
    # Rows are padded for OpenBLAS (5 -> 8) only where a product still runs on it.
    assert engine.info.padded(5) == (8 if cpu_blas == "numpy" and expected == 1 else 5)
    seen.clear()
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))
    engine.run_to_completion()
    assert seen and set(seen) == {expected}
