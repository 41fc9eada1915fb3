"""Load a checkpoint: a Hugging Face model directory (config, safetensors weights,
generation defaults), pre-quantized by `tokenmill quantize` or not (model/prequantized.py),
or a GGUF file (model/gguf.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from tokenmill.layers import huge_pages, weight_arena
from tokenmill.layers.block_tensor import BlockTensor
from tokenmill.layers.linear import LinearSelector, bind_linear_methods, finalize_linear_methods
from tokenmill.layers.parallel import SINGLE_RANK, Collectives, bind_collectives
from tokenmill.layers.products import ProductPolicy
from tokenmill.layers.quantized_tensor import SavedQuantTensor
from tokenmill.model.arch import ArchConfig
from tokenmill.model.gguf import GGUFCheckpoint, is_gguf
from tokenmill.model.prequantized import quantized_weight_names, saved_quantization, saved_weights
from tokenmill.model.registry import resolve_model_class

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    arch: ArchConfig
    generation_config: dict[str, Any]
    device: torch.device
    dtype: torch.dtype
    # This rank's geometry (arch itself without tensor parallelism): what the model
    # was built from and its KV cache holds.
    local_arch: ArchConfig | None = None

    def __post_init__(self) -> None:
        if self.local_arch is None:
            self.local_arch = self.arch


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    # This CPU has no native 16-bit arithmetic: fp32 computes fastest there.
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The config spelling of a torch dtype (the inverse of resolve_dtype)."""
    return next(name for name, value in _DTYPES.items() if value == dtype)


def read_config(model_dir: str | Path) -> ArchConfig:
    """The shape of a Hugging Face model directory or a GGUF file."""
    path = Path(model_dir)
    if is_gguf(path):
        return ArchConfig.from_hf_config(GGUFCheckpoint(path).hf_config())
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {str(path)!r} is not a Hugging Face model directory "
                         "(no config.json)")
    return ArchConfig.from_hf_config(json.loads((path / "config.json").read_text()))


def read_generation_config(model_dir: str | Path) -> dict[str, Any]:
    if is_gguf(model_dir):
        return GGUFCheckpoint(model_dir).generation_config()
    path = Path(model_dir) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {str(model_dir)!r}")
    return files


def iterate_weights(files: list[Path], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    handles = [safe_open(str(f), framework="pt") for f in files]
    names = [(h, n) for h in handles for n in h.keys()]
    for handle, name in tqdm(names, desc="Loading weights", unit="tensor", disable=not progress,
                             leave=False):
        yield name, handle.get_tensor(name)


CheckpointTensor = torch.Tensor | BlockTensor | SavedQuantTensor


def checkpoint_weights(model_dir: Path, arch: ArchConfig, progress: bool
                       ) -> Iterator[tuple[str, CheckpointTensor]]:
    if is_gguf(model_dir):
        return GGUFCheckpoint(model_dir).weights(arch.tie_word_embeddings)
    if saved_quantization(model_dir) is not None:
        return saved_weights(safetensors_files(model_dir), progress)
    return iterate_weights(safetensors_files(model_dir), progress)


def linear_layer_name(arch: ArchConfig, weight_name: str) -> str:
    """The Linear layer a checkpoint weight ("...q_proj.weight") loads into ("...qkv_proj")."""
    model_class = resolve_model_class(arch.architecture)
    if arch.tie_word_embeddings and weight_name == "model.embed_tokens.weight":
        weight_name = "lm_head.weight"  # the LM head is the embedding table
    name = model_class.rename_checkpoint_tensor(weight_name)
    for part, (fused, _shard) in model_class.STACKED_PARAMS.items():
        if f".{part}." in name:
            name = name.replace(part, fused)
    return name.rsplit(".", 1)[0]


def linear_weight_formats(model_dir: str | Path) -> dict[str, set[str]]:
    """For a GGUF file, each Linear layer's name -> the GGUF formats of the checkpoint
    tensors loaded into it (a fused layer has several); {} for a safetensors directory."""
    if not is_gguf(model_dir):
        return {}
    checkpoint = GGUFCheckpoint(model_dir)
    arch = ArchConfig.from_hf_config(checkpoint.hf_config())
    formats: dict[str, set[str]] = {}
    for name, format in checkpoint.tensor_formats().items():
        formats.setdefault(linear_layer_name(arch, name), set()).add(format)
    return formats


def saved_quantized_layers(model_dir: str | Path) -> set[str]:
    """For a pre-quantized directory, the Linear layers whose weights it holds quantized
    (a fused layer's parts are all quantized or all float); empty for any other checkpoint."""
    if is_gguf(model_dir) or saved_quantization(model_dir) is None:
        return set()
    arch = read_config(model_dir)
    return {linear_layer_name(arch, name)
            for name in quantized_weight_names(safetensors_files(Path(model_dir)))}


class ModelPart(Protocol):
    """A part of the model to build instead of all of it (a pipeline stage,
    dist/pipeline.py): its geometry, the modules it drops, the tensors it holds."""

    def arch(self, arch: ArchConfig) -> ArchConfig: ...

    def prune(self, model: torch.nn.Module) -> None: ...

    def local_name(self, name: str, tied: bool) -> str | None: ...


def _stage_weights(weights: Iterator[tuple[str, CheckpointTensor]], stage: ModelPart,
                   tied: bool) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint tensors a pipeline stage holds, under its own layer numbers."""
    for name, tensor in weights:
        local = stage.local_name(name, tied)
        if local is not None:
            yield local, tensor


def load_model(model_dir: str | Path, dtype: str = "auto", device: str = "auto",
               max_positions: int | None = None, progress: bool = True,
               select_linear: LinearSelector | None = None,
               group: Collectives = SINGLE_RANK,
               stage: ModelPart | None = None,
               expert_slots: tuple[int, ...] | None = None) -> LoadedModel:
    """Build the model for a checkpoint directory and load its weights.

    select_linear picks each Linear layer's method (layers/products.py); default:
    torch's own products for the device. With a tensor-parallel group the model is
    built from this rank's geometry and loads its shard (the methods select_linear
    picks must split the layers: dist/tensor_parallel.py). A pipeline stage builds
    and loads only its layers (dist/pipeline.py).
    """
    model_dir = Path(model_dir)
    arch = read_config(model_dir)
    model_class = resolve_model_class(arch.architecture)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    positions = max_positions or arch.max_position_embeddings
    local_arch = arch.sharded(group.size, group.rank if group.expert_parallel else None,
                              expert_slots)
    if stage is not None:
        local_arch = stage.arch(local_arch)
    with torch.device("meta"):
        model = model_class(local_arch, positions)
        if stage is not None:
            stage.prune(model)
        bind_linear_methods(model, select_linear or ProductPolicy(torch_device).select)
    bind_collectives(model, group)
    model = model.to_empty(device=torch_device).to(torch_dtype)
    weight_arena.gather(model)  # the packed-in-place weights in one allocation (when asked)
    huge_pages.advise_module(model)  # before the checkpoint is written in (when asked)
    # Rotary tables stay in float32 whatever the weights' dtype.
    model.model.rotary.float()
    weights = checkpoint_weights(model_dir, arch, progress)
    if stage is not None:
        weights = _stage_weights(weights, stage, arch.tie_word_embeddings)
    loaded = model.load_weights(weights)
    missing = model.expected_weights() - loaded
    if missing:
        raise ValueError(f"checkpoint in {str(model_dir)!r} lacks weights: {sorted(missing)[:8]}")
    model.post_load()
    model.eval().requires_grad_(False)
    finalize_linear_methods(model)
    return LoadedModel(model, arch, read_generation_config(model_dir), torch_device, torch_dtype,
                       local_arch)
