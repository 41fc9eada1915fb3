"""`tokenmill quantize`: write a pre-quantized checkpoint (model/prequantized.py).

The float checkpoint is loaded and quantized exactly as an engine quantizes it at load
(the same product policy, loader and AWQ calibration, one rank), and every quantized
Linear's codes are written back under the checkpoint names they came from: a fused
layer's rows are cut back into its parts (q, k, v; gate, up; each expert), so the
saved directory loads through the models' own name mapping, as the float one does.
Tensors that were not quantized (norms, biases, an untied embedding, excluded or
unfitting layers, MoE routers) are copied as they are.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenmill.arguments import add_engine_arguments, engine_config_from_args
from tokenmill.config import EngineConfig
from tokenmill.layers.linear import Linear
from tokenmill.layers.products import product_policy
from tokenmill.layers.quantized_tensor import pack_nibbles
from tokenmill.model.gguf import is_gguf
from tokenmill.model.loader import (
    iterate_weights,
    load_model,
    resolve_device,
    resolve_dtype,
    safetensors_files,
)
from tokenmill.model.prequantized import (
    CODES,
    INPUT_SCALE,
    OFFSETS,
    SCALES,
    SETTINGS,
    quantization_block,
    saved_quantization,
)
from tokenmill.quant.formats import QuantizedWeight
from tokenmill.quant.packing import unpack
from tokenmill.quant.policy import scheme_for
from tokenmill.worker.calibration import calibrate
from tokenmill.worker.memory import target_products

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
# Files of the float checkpoint the saved one does not copy (it writes its own).
NOT_COPIED = ("config.json", "model.safetensors.index.json")


def add_quantize_subcommand(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser("quantize", help="quantize a float checkpoint once and save it "
                         "(load the output directory with --model, no re-quantization)")
    cmd.add_argument("--output", required=True, help="directory to write (new or empty)")
    cmd.add_argument("--log-level", default="info")
    add_engine_arguments(cmd)
    cmd.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    try:
        config = engine_config_from_args(args)
        start = time.perf_counter()
        summary = quantize_checkpoint(config, Path(args.output))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{summary['layers']} layers saved {summary['scheme']} in "
          f"{args.output} ({summary['bytes'] / 2**20:.1f} MiB of weights, "
          f"{time.perf_counter() - start:.1f} s)")
    return 0


def check_paths(config: EngineConfig, output: Path) -> Path:
    """The float checkpoint directory; raises ValueError for what cannot be quantized."""
    source = Path(config.model.model)
    if config.quant.quantization == "none":
        raise ValueError("quantization: tokenmill quantize needs 'int8' or 'int4'")
    if is_gguf(source) or not (source / "config.json").is_file():
        raise ValueError(f"model: {str(source)!r} is not a Hugging Face model directory "
                         "(tokenmill quantize reads float safetensors checkpoints)")
    if saved_quantization(source) is not None:
        raise ValueError(f"model: {str(source)!r} is pre-quantized already; quantize its "
                         "float checkpoint")
    if config.parallel.world_size > 1:
        raise ValueError("tensor_parallel_size, pipeline_parallel_size: tokenmill quantize "
                         "runs on one rank (the saved checkpoint then loads on one rank)")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(f"output: {str(output)!r} exists and is not an empty directory")
    return source


def load_quantized(config: EngineConfig, progress: bool = True) -> torch.nn.Module:
    """The model quantized as a one-rank worker quantizes it at load (worker/worker.py)."""
    mcfg = config.model
    if mcfg.num_threads:
        torch.set_num_threads(mcfg.num_threads)
    device = resolve_device(mcfg.device)
    dtype = resolve_dtype(mcfg.dtype, device)
    products = target_products(config, product_policy(mcfg.cpu_blas, device, dtype), dtype)
    loaded = load_model(mcfg.model, mcfg.dtype, mcfg.device, mcfg.max_model_len,
                        progress=progress, select_linear=products.selector)
    calibrate(loaded.model, config)
    return loaded.model


def quantized_layer(model: torch.nn.Module, name: str) -> tuple[Linear, slice] | None:
    """The quantized Linear a checkpoint weight loads into and its rows there, or None
    for a tensor that stays float. Follows the model's own loading (llama.py's
    _load_tensor), tied embedding included."""
    if model.arch.tie_word_embeddings and name == "model.embed_tokens.weight":
        name = "lm_head.weight"
    if not name.endswith(".weight"):
        return None
    target, rows = model._locate(name)
    try:
        module_name, param = model._split_owner(target)
    except AttributeError:
        return None
    layer = model.get_submodule(module_name)
    if not isinstance(layer, Linear) or param != "weight" or not hasattr(layer, "quantized"):
        return None
    return layer, rows or slice(0, layer.out_features)


def saved_tensors(name: str, weight: QuantizedWeight, layer: Linear
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors for one quantized checkpoint weight (name "X.weight")."""
    module = name.removesuffix(".weight")
    codes = pack_nibbles(weight.codes) if weight.bits == 4 else weight.codes
    yield f"{module}.{CODES}", codes
    yield f"{module}.{SCALES}", weight.scales
    if weight.offsets is not None:
        yield f"{module}.{OFFSETS}", weight.offsets
    if hasattr(layer, "input_scale"):
        yield f"{module}.{INPUT_SCALE}", layer.input_scale


def checkpoint_tensors(model: torch.nn.Module, source: Path, progress: bool
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the saved checkpoint: quantized weights as codes, the rest as is."""
    unpacked: dict[int, QuantizedWeight] = {}
    tied = model.arch.tie_word_embeddings
    for source_name, source_tensor in iterate_weights(safetensors_files(source), progress):
        for name, tensor in model.split_checkpoint_tensor(source_name, source_tensor):
            if tied and name == "lm_head.weight":
                continue  # the embedding table is the LM head (the loader skips this)
            found = quantized_layer(model, name)
            if found is None:
                yield name, tensor
                continue
            layer, rows = found
            if id(layer) not in unpacked:
                unpacked[id(layer)] = unpack(layer.quantized)
            yield from saved_tensors(name, unpacked[id(layer)].rows(rows), layer)


def quantize_checkpoint(config: EngineConfig, output: Path, progress: bool = True) -> dict:
    """Quantize config's model with its quantization settings and write the pre-quantized
    checkpoint to `output`. Returns a summary (scheme, layers, bytes)."""
    source = check_paths(config, output)
    model = load_quantized(config, progress)
    tensors = {name: tensor.detach().contiguous().clone()
               for name, tensor in checkpoint_tensors(model, source, progress)}
    scheme = scheme_for(config.quant)
    output.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output / WEIGHTS_FILE),
              metadata={"format": "pt", "quantization": scheme.name})
    hf_config = json.loads((source / "config.json").read_text())
    settings = {key: getattr(config.quant, key) for key in SETTINGS}
    hf_config["quantization_config"] = quantization_block(settings, scheme.bits)
    (output / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    for path in sorted(source.iterdir()):
        if path.is_file() and path.suffix != ".safetensors" and path.name not in NOT_COPIED:
            shutil.copy2(path, output / path.name)
        elif path.is_dir():
            logger.info("not copied: %s (a directory: e.g. an EAGLE head trained for the "
                        "float model)", path.name)
    layers = sum(1 for m in model.modules() if isinstance(m, Linear) and hasattr(m, "quantized"))
    return {"scheme": scheme.name, "layers": layers,
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
