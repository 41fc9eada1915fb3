"""An EAGLE head on disk: a directory with `config.json` (its geometry and the target
it was trained for) and `model.safetensors` (float32, checkpoint layout [out, in])."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tokenmill.layers.linear import (
    Linear,
    LinearSelector,
    bind_linear_methods,
    finalize_linear_methods,
)
from tokenmill.layers.products import ProductPolicy
from tokenmill.model.arch import ArchConfig
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.speculative.eagle.head import EagleHead, head_arch

FORMAT = "tokenmill-eagle-1"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Fields the head shares with its target: the embedding and LM head are the
# target's, and the decoder layer uses the target's attention geometry.
TARGET_GEOMETRY = ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim")
# Fields that shape the head's own weights.
HEAD_GEOMETRY = TARGET_GEOMETRY + ("intermediate_size", "rms_norm_eps", "qkv_bias",
                                   "o_proj_bias", "mlp_bias", "qk_norm", "rope")


def head_config(arch: ArchConfig, target: dict[str, Any]) -> dict[str, Any]:
    """config.json of a head with this arch, trained for `target` (provenance)."""
    geometry = {name: getattr(arch, name) for name in HEAD_GEOMETRY}
    return {"format": FORMAT, **geometry, "target": target}


def save_eagle_head(head: EagleHead, out_dir: Path, target: dict[str, Any]) -> None:
    """Write config.json and model.safetensors (float32, [out, in] matrices)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, param in head.named_parameters():
        owner = head.get_submodule(name.rpartition(".")[0])
        tensor = param.detach()
        if isinstance(owner, Linear) and name.endswith(".weight"):
            tensor = owner.checkpoint_weight()
        tensors[name] = tensor.float().contiguous().cpu()
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": FORMAT})
    config = head_config(head.arch, target)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")


def read_head_config(head_dir: str | Path, target_arch: ArchConfig) -> tuple[ArchConfig, dict]:
    """The head arch and config.json saved in head_dir, checked against the target.

    Raises ValueError when the head was built for a target of another geometry.
    """
    head_dir = Path(head_dir)
    config_path = head_dir / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"EAGLE head: no {CONFIG_FILE} in {str(head_dir)!r}")
    config = json.loads(config_path.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"EAGLE head: {str(config_path)!r} has format "
                         f"{config.get('format')!r}, expected {FORMAT!r}")
    mismatched = [f"{name}: head {config[name]!r}, target {getattr(target_arch, name)!r}"
                  for name in TARGET_GEOMETRY if config[name] != getattr(target_arch, name)]
    if mismatched:
        raise ValueError(f"EAGLE head in {str(head_dir)!r} does not fit this target model ("
                         + "; ".join(mismatched) + ")")
    arch = dataclasses.replace(head_arch(target_arch),
                               **{name: config[name] for name in HEAD_GEOMETRY})
    return arch, config


def load_eagle_head(head_dir: str | Path, target_model: LlamaForCausalLM,
                    select_linear: LinearSelector | None = None,
                    target_arch: ArchConfig | None = None) -> EagleHead:
    """The head saved in head_dir, on the target's device and dtype, ready to draft;
    its Linear layers take the methods select_linear picks (default: torch's own).

    Raises ValueError when the head was built for a target of another geometry.
    """
    # The target's whole geometry (its model may be one tensor-parallel rank's shard).
    arch, _ = read_head_config(head_dir, target_arch or target_model.arch)
    reference = next(target_model.parameters())
    rotary = target_model.model.rotary
    head = EagleHead(arch, rotary.max_positions)
    bind_linear_methods(head, select_linear or ProductPolicy(reference.device).select)
    load_head_weights(head, load_file(str(Path(head_dir) / WEIGHTS_FILE)), Path(head_dir))
    head.place(reference.device, reference.dtype)
    head.eval().requires_grad_(False)
    finalize_linear_methods(head)
    return head


@torch.no_grad()
def load_head_weights(head: EagleHead, tensors: dict[str, torch.Tensor], source: Path) -> None:
    expected = {name for name, _ in head.named_parameters()}
    if set(tensors) != expected:
        raise ValueError(f"EAGLE head weights in {str(source)!r}: missing "
                         f"{sorted(expected - set(tensors))}, unexpected "
                         f"{sorted(set(tensors) - expected)}")
    for name, tensor in tensors.items():
        module_name, _, param_name = name.rpartition(".")
        owner = head.get_submodule(module_name)
        try:
            if isinstance(owner, Linear):
                owner.load(param_name, tensor)
            else:
                getattr(owner, param_name).copy_(tensor)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"EAGLE head tensor {name!r} ({tuple(tensor.shape)}) in "
                             f"{str(source)!r} does not fit: {exc}") from None
