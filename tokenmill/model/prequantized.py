"""Pre-quantized checkpoints, as `tokenmill quantize` writes them: a Hugging Face model
directory whose config.json has a `quantization_config` block and whose safetensors hold
each quantized Linear weight `X.weight` as `X.codes`, `X.scales`, `X.offsets` (4 bits)
and `X.input_scale` (AWQ) instead (layers/quantized_tensor.py has the layouts); every
other tensor is the float checkpoint's own.

    "quantization_config": {
        "quant_method": "tokenmill", "format_version": 1,
        "quantization": "int4", "quantization_method": "hqq",
        "quantization_group_size": 128, "quantization_exclude": "lm_head",
        "quantization_calibration": null, "bits": 4
    }

The quantization_* fields are the engine's own (config.py's QuantConfig): the
checkpoint says which settings quantized it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from tokenmill.layers.quantized_tensor import SavedQuantTensor

QUANT_METHOD = "tokenmill"
FORMAT_VERSION = 1
# Field of QuantConfig -> recorded in the block (and compared with an engine's request).
SETTINGS = ("quantization", "quantization_method", "quantization_group_size",
            "quantization_exclude", "quantization_calibration")
# Suffixes of a quantized weight's tensors, beside its module's name.
CODES, SCALES, OFFSETS, INPUT_SCALE = "codes", "scales", "offsets", "input_scale"


def quantization_block(settings: dict[str, Any], bits: int) -> dict[str, Any]:
    """The config.json block for a checkpoint quantized with these QuantConfig settings."""
    return {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION,
            **{key: settings[key] for key in SETTINGS}, "bits": bits}


def saved_quantization(model_dir: str | Path) -> dict[str, Any] | None:
    """The settings a pre-quantized directory was quantized with (QuantConfig fields), or
    None for a float checkpoint (or a GGUF file). Raises ValueError for another tool's
    quantization_config (GPTQ, AWQ's own format, bitsandbytes...), which tokenmill does
    not read, and for a block of a format version it does not know."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return None
    block = json.loads(config_path.read_text()).get("quantization_config")
    if block is None:
        return None
    method = block.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(f"model: quantization_config.quant_method {method!r} in "
                         f"{str(config_path)!r} is not a format tokenmill reads (only its "
                         f"own {QUANT_METHOD!r}, from `tokenmill quantize`); load the float "
                         "checkpoint and quantize it with --quantization")
    if block.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"model: quantization_config.format_version "
                         f"{block.get('format_version')!r} is not {FORMAT_VERSION}")
    missing = [key for key in SETTINGS if key not in block]
    if missing:
        raise ValueError(f"model: quantization_config lacks {missing}")
    return {key: block[key] for key in SETTINGS}


def quantized_weight_names(files: list[Path]) -> set[str]:
    """The checkpoint weight names ("X.weight") saved quantized."""
    names = set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names |= {key[:-len(CODES)] + "weight" for key in handle.keys()
                      if key.endswith("." + CODES)}
    return names


def saved_weights(files: list[Path], progress: bool = True
                  ) -> Iterator[tuple[str, torch.Tensor | SavedQuantTensor]]:
    """(checkpoint name, tensor) of a pre-quantized checkpoint: a quantized weight comes
    as one SavedQuantTensor named "X.weight", every other tensor as it is."""
    handles = {}
    for file in files:
        handle = safe_open(str(file), framework="pt")
        handles.update(dict.fromkeys(handle.keys(), handle))
    modules = {key[:-len(CODES) - 1] for key in handles if key.endswith("." + CODES)}
    parts = {f"{module}.{part}" for module in modules for part in (SCALES, OFFSETS, INPUT_SCALE)}

    def read(name: str) -> torch.Tensor | None:
        return handles[name].get_tensor(name) if name in handles else None

    names = [name for name in handles if name not in parts]
    for name in tqdm(names, desc="Loading weights", unit="tensor", disable=not progress,
                     leave=False):
        if name.endswith("." + CODES):
            module = name[:-len(CODES) - 1]
            codes = read(name)
            scales = read(f"{module}.{SCALES}")
            if scales is None:
                raise ValueError(f"model: pre-quantized weight {module!r} has codes but no "
                                 f"{SCALES!r}")
            yield f"{module}.weight", SavedQuantTensor(
                8 if codes.dtype == torch.int8 else 4, codes, scales,
                read(f"{module}.{OFFSETS}"), read(f"{module}.{INPUT_SCALE}"))
        else:
            yield name, read(name)
