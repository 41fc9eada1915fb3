"""tokenmill: an LLM inference and serving engine where every optimization is a measured switch.

The names below are imported on first use, so that the torch-free parts of the package
(`tokenmill.core`, `tokenmill.config`) can be imported without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "tokenmill.llm",
    "EngineConfig": "tokenmill.config",
    "SamplingParams": "tokenmill.sampling_params",
    "RequestOutput": "tokenmill.outputs",
    "CompletionOutput": "tokenmill.outputs",
    "TokenLogprob": "tokenmill.outputs",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
