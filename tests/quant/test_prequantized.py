"""A checkpoint saved by `tokenmill quantize` loads as saved: every layer's packed codes,
scales, offsets and AWQ scale equal what quantizing the float checkpoint at load gives,
its greedy tokens equal that engine's, and bad requests fail naming the field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.dist.test_tensor_parallel import assert_same, generate
from tests.engine_run import run_staggered
from tests.models import TOKENIZER_CORPUS
from tokenmill import SamplingParams
from tokenmill.cli import main
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.layers.linear import Linear
from tokenmill.layers.products import ProductPolicy
from tokenmill.model.loader import safetensors_files
from tokenmill.model.prequantized import saved_weights
from tokenmill.quant.methods import QuantizedLinearMethod
from tokenmill.quant.saved import SavedLinearMethod
from tokenmill.quantize import quantize_checkpoint
from tokenmill.worker.memory import plan_deployment_memory, target_products

PROMPTS = [[5, 17, 42, 99, 3, 8, 1, 2, 3, 4, 5, 6, 7], list(range(20, 61)), [7, 7, 7], [300, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

CASES = [
    ("llama", {"quantization": "int8"}),
    ("llama", {"quantization": "int4", "quantization_group_size": 32}),
    ("llama_mqa_tied", {"quantization": "int4", "quantization_group_size": 32,
                        "quantization_method": "hqq"}),
    ("qwen2", {"quantization": "int4", "quantization_group_size": 32,
               "quantization_method": "awq"}),
    ("mixtral", {"quantization": "int4", "quantization_group_size": 64,
                 "quantization_method": "hqq"}),
    ("qwen2_moe", {"quantization": "int8", "quantization_group_size": 32,
                   "quantization_exclude": "lm_head"}),
]


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calibration") / "calibration.txt"
    path.write_text("".join(TOKENIZER_CORPUS) * 4)
    return path


def with_calibration(options: dict, calibration_file) -> dict:
    if options.get("quantization_method") == "awq":
        return {**options, "quantization_calibration": str(calibration_file)}
    return options


def engine(model_dir, **options) -> LLMEngine:
    return LLMEngine.from_kwargs(str(model_dir), progress=False, block_size=8,
                                 max_num_batched_tokens=24, **options)


def linear_layers(engine: LLMEngine) -> dict[str, Linear]:
    model = engine.executor.worker.runner.model
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def saved(model_dir, out_dir, **options):
    config = EngineConfig.from_kwargs(model=str(model_dir), **options)
    return quantize_checkpoint(config, out_dir, progress=False)


@pytest.mark.parametrize("family, options", CASES)
def test_saved_checkpoint_loads_the_weights_and_tokens_of_quantizing_at_load(
        model_factory, calibration_file, tmp_path, family, options):
    options = with_calibration(options, calibration_file)
    model_dir = model_factory(family)
    summary = saved(model_dir, tmp_path / "saved", **options)
    at_load, loaded = engine(model_dir, **options), engine(tmp_path / "saved")
    expected = linear_layers(at_load)
    layers = linear_layers(loaded)
    quantized = {n for n, m in expected.items() if isinstance(m.method, QuantizedLinearMethod)}
    assert summary["layers"] == len(quantized) > 0
    assert {n for n, m in layers.items() if isinstance(m.method, SavedLinearMethod)} == quantized
    for name, layer in layers.items():
        reference = expected[name]
        if name not in quantized:  # float layers: the checkpoint's own weights
            x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
            assert torch.equal(layer(x), reference(x)), name
            continue
        assert layer.weight.numel() == 0  # no float copy beside the codes
        ours, theirs = layer.quantized, reference.quantized
        assert (ours.bits, ours.group_size) == (theirs.bits, theirs.group_size)
        for field in ("codes", "scales", "offsets"):
            a, b = getattr(ours, field), getattr(theirs, field)
            assert (a is None and b is None) or torch.equal(a, b), (name, field)
        if hasattr(reference, "input_scale"):
            assert torch.equal(layer.input_scale, reference.input_scale)
        if reference.bias is not None:
            assert torch.equal(layer.bias, reference.bias)
    assert (run_staggered(loaded, PROMPTS, GREEDY, arrivals=[0, 1, 1, 4])
            == run_staggered(at_load, PROMPTS, GREEDY, arrivals=[0, 1, 1, 4]))
    assert loaded.info.memory.weights == at_load.info.memory.weights


def test_pipeline_stages_load_their_layers_of_a_saved_checkpoint(model_factory, tmp_path):
    """Each stage names its layers by their number within it, and the first stage holds
    the tied head (the embedding) too: each stage keeps the codes quantizing at load
    keeps there, and the stages give one rank's tokens."""
    model_dir, options = model_factory("llama_mqa_tied"), {
        "quantization": "int4", "quantization_group_size": 32}
    saved(model_dir, tmp_path / "saved", **options)
    reference, _ = generate(tmp_path / "saved")
    outputs, engine = generate(tmp_path / "saved", pipeline_parallel_size=2)
    assert_same(reference, outputs)
    _, at_load = generate(model_dir, pipeline_parallel_size=2, **options)
    assert ([m.weights for m in engine.executor.rank_memory]
            == [m.weights for m in at_load.executor.rank_memory])


def test_saved_file_holds_quarter_or_less_of_the_float_bytes_and_describes_itself(
        model_factory, tmp_path):
    model_dir = model_factory("llama")
    saved(model_dir, tmp_path / "int4", quantization="int4", quantization_group_size=32)
    block = json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]
    assert block == {"quant_method": "tokenmill", "format_version": 1, "quantization": "int4",
                     "quantization_method": "rtn", "quantization_group_size": 32,
                     "quantization_exclude": "", "quantization_calibration": None, "bits": 4}
    for name in ("tokenizer.json", "generation_config.json"):
        assert (tmp_path / "int4" / name).read_bytes() == (model_dir / name).read_bytes()
    float_bytes = (model_dir / "model.safetensors").stat().st_size
    # The embedding (untied, 384 x 64) stays float; the projections take ~0.19 of theirs.
    assert (tmp_path / "int4" / "model.safetensors").stat().st_size < 0.45 * float_bytes


def test_memory_plan_of_a_saved_checkpoint_counts_its_codes(model_factory, tmp_path):
    model_dir = model_factory("llama_mqa_tied")
    options = {"quantization": "int4", "quantization_group_size": 32}
    saved(model_dir, tmp_path / "saved", **options)
    at_load = plan_deployment_memory(EngineConfig.from_kwargs(model=str(model_dir), **options),
                                     64, 1, 2**30)
    loaded = plan_deployment_memory(EngineConfig.from_kwargs(model=str(tmp_path / "saved")),
                                    64, 1, 2**30)
    assert loaded.weights_bytes == at_load.weights_bytes
    assert "saved-int4-rtn-g32" in loaded.products


def test_the_command_line_writes_a_checkpoint_that_generates(model_factory, tmp_path, capsys):
    model_dir = model_factory("llama")
    out = tmp_path / "int8"
    assert main(["quantize", "--model", str(model_dir), "--quantization", "int8",
                 "--output", str(out), "--log-level", "warning"]) == 0
    assert "layers saved int8" in capsys.readouterr().out
    assert main(["generate", "--model", str(out), "--prompt", "def add(a, b):",
                 "--max-tokens", "4"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--prompt", "def add(a, b):",
                 "--quantization", "int4"]) == 2
    assert "error: quantization: the checkpoint is pre-quantized (int8" in capsys.readouterr().err


@pytest.fixture(scope="module")
def saved_hqq(model_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("saved") / "hqq"
    saved(model_factory("llama"), out, quantization="int4", quantization_group_size=32,
          quantization_method="hqq")
    return out


@pytest.mark.parametrize("options, field", [
    ({"quantization": "int8"}, "quantization"),
    ({"quantization": "int4", "quantization_group_size": 32}, "quantization_method"),
    ({"quantization": "int4", "quantization_method": "hqq"}, "quantization_group_size"),
    ({"quantization": "int4", "quantization_method": "hqq", "quantization_group_size": 32,
      "quantization_exclude": "lm_head"}, "quantization_exclude"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
])
def test_asking_a_saved_checkpoint_for_other_weights_fails_naming_the_field(
        saved_hqq, options, field):
    config = EngineConfig.from_kwargs(model=str(saved_hqq), **options)
    with pytest.raises(ValueError, match=f"^{field}: "):
        target_products(config, ProductPolicy(torch.device("cpu")), torch.float32)


def test_repeating_the_saved_settings_loads_it_as_saved(saved_hqq):
    config = EngineConfig.from_kwargs(model=str(saved_hqq), quantization="int4",
                                      quantization_group_size=32, quantization_method="hqq")
    policy = target_products(config, ProductPolicy(torch.device("cpu")), torch.float32)
    assert policy.name == "torch, saved-int4-hqq-g32"


def test_a_saved_checkpoint_runs_float32_on_the_cpu_only(saved_hqq):
    config = EngineConfig.from_kwargs(model=str(saved_hqq))
    with pytest.raises(ValueError, match="^model: .*float32 on the CPU"):
        target_products(config, ProductPolicy(torch.device("cpu")), torch.bfloat16)


def test_another_tools_quantization_config_fails_naming_it(llama_dir, tmp_path):
    copy = shutil.copytree(llama_dir, tmp_path / "gptq")
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="^model: quantization_config.quant_method 'gptq'"):
        engine(copy)


@pytest.mark.parametrize("options, output_exists, message", [
    ({}, False, "^quantization: tokenmill quantize needs"),
    ({"quantization": "int8"}, True, "^output: .* is not an empty directory"),
])
def test_quantize_rejects_bad_requests(llama_dir, tmp_path, options, output_exists, message):
    out = tmp_path / "out"
    if output_exists:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match=message):
        saved(llama_dir, out, **options)


def test_quantizing_a_saved_checkpoint_again_fails(saved_hqq, tmp_path):
    with pytest.raises(ValueError, match="^model: .* is pre-quantized already"):
        saved(saved_hqq, tmp_path / "again", quantization="int8")


def test_a_method_that_keeps_no_codes_loads_the_saved_weight_dequantized(saved_hqq, llama_dir):
    at_load = engine(llama_dir, quantization="int4", quantization_group_size=32,
                     quantization_method="hqq")
    reference = linear_layers(at_load)["model.layers.0.mlp.gate_up_proj"].checkpoint_weight()
    tensors = dict(saved_weights(safetensors_files(saved_hqq), progress=False))
    gate = tensors["model.layers.0.mlp.gate_proj.weight"]
    plain = Linear(gate.shape[1], gate.shape[0])  # the plain method: float weights
    plain.load("weight", gate)
    assert torch.equal(plain.weight, reference[:gate.shape[0]])


def test_codes_without_scales_fail_naming_the_weight(saved_hqq, tmp_path):
    from safetensors.torch import load_file, save_file

    copy = shutil.copytree(saved_hqq, tmp_path / "broken")
    tensors = load_file(copy / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.scales"]
    save_file(tensors, copy / "model.safetensors")
    with pytest.raises(ValueError, match="'model.layers.0.mlp.down_proj' has codes but no"):
        engine(copy)
