"""From `architectures` in config.json to the class that runs it."""

from __future__ import annotations

from torch import nn

from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.mixtral import MixtralForCausalLM
from tokenmill.model.qwen_moe import QwenMoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": QwenMoeForCausalLM,
    "Qwen3MoeForCausalLM": QwenMoeForCausalLM,
}


def resolve_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"tokenmill supports: {supported}") from None
