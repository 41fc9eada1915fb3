"""The quantization knobs reject bad values and unsupported combinations with an error
naming the field, at construction (or at engine start for the device and dtype)."""

from __future__ import annotations

import pytest

from tokenmill.arguments import add_engine_arguments, engine_config_from_args
from tokenmill.config import EngineConfig, QuantConfig
from tokenmill.engine.engine import LLMEngine


@pytest.mark.parametrize("options, field", [
    ({"quantization": "int3"}, "quantization"),
    ({"quantization": "int4", "quantization_group_size": 48}, "quantization_group_size"),
    ({"quantization": "int4", "quantization_method": "gptq"}, "quantization_method"),
    ({"quantization": "int8", "quantization_method": "hqq"}, "quantization_method"),
    ({"quantization": "int8", "quantization_exclude": "lm_head,,"}, "quantization_exclude"),
    ({"quantization_group_size": 32}, "quantization"),
    ({"quantization_exclude": "lm_head"}, "quantization"),
    ({"quantization": "int4", "quantization_method": "awq"}, "quantization_calibration"),
    ({"quantization": "int4", "quantization_calibration": "x.txt"}, "quantization_calibration"),
    ({"quantization": "int8", "quantization_method": "awq",
      "quantization_calibration": "x.txt"}, "quantization_method"),
])
def test_bad_quantization_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        EngineConfig.from_kwargs(**options)


def test_group_size_defaults_per_bit_width():
    assert QuantConfig(quantization="int4").group_size == 128
    assert QuantConfig(quantization="int8").group_size is None  # one scale per channel
    assert QuantConfig(quantization="int8", quantization_group_size=32).group_size == 32
    assert QuantConfig(quantization="int4", quantization_exclude=" lm_head , *.0.* "
                       ).exclude_patterns == ("lm_head", "*.0.*")


def test_cli_flags_come_from_the_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--quantization", "int4", "--quantization-group-size", "64",
                              "--quantization-method", "hqq", "--quantization-exclude",
                              "lm_head"])
    quant = engine_config_from_args(args).quant
    assert (quant.quantization, quant.group_size, quant.quantization_method,
            quant.exclude_patterns) == ("int4", 64, "hqq", ("lm_head",))
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int2"])


def test_quantization_needs_float32_on_the_cpu(llama_dir):
    with pytest.raises(ValueError, match="quantization: 'int8' runs float32 models"):
        LLMEngine.from_kwargs(str(llama_dir), progress=False, quantization="int8",
                              dtype="bfloat16")


def test_awq_calibration_text_must_exist(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="quantization_calibration: .* neither a file"):
        LLMEngine.from_kwargs(str(llama_dir), progress=False, quantization="int4",
                              quantization_group_size=32, quantization_method="awq",
                              quantization_calibration=str(tmp_path / "missing"))
