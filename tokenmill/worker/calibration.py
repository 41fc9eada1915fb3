"""Calibration for activation-aware quantization (`--quantization-method awq`): the
loaded float model runs the calibration text, every AWQ layer records its inputs, and
then each layer is quantized from them (quant/awq.py)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch import nn

from tokenmill.attention.window import window_attention
from tokenmill.chat import load_tokenizer
from tokenmill.config import EngineConfig
from tokenmill.layers.linear import Linear
from tokenmill.quant.awq import record_inputs
from tokenmill.quant.methods import AwqLinearMethod

logger = logging.getLogger(__name__)

WINDOW = 256
NUM_WINDOWS = 8
WINDOWS_PER_FORWARD = 2
# Rows of the final hidden states the LM head sees (all of them would cost a
# [tokens, vocab] product).
LM_HEAD_STRIDE = 8


def calibration_text(path: Path) -> str:
    if path.is_file():
        return path.read_text(errors="replace")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".py", ".txt",
                                                                                  ".md"))
        return "\n".join(p.read_text(errors="replace") for p in files[:200])
    raise ValueError(f"quantization_calibration: {str(path)!r} is neither a file nor a "
                     "directory")


def calibration_windows(config: EngineConfig) -> torch.Tensor:
    """[windows, WINDOW] token ids: the calibration text's first tokens."""
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
    text = calibration_text(Path(config.quant.quantization_calibration))
    # verbose=False: a text longer than the model's context is expected here (it is cut).
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    ids = ids[:WINDOW * NUM_WINDOWS]
    windows = len(ids) // WINDOW
    if windows == 0:
        raise ValueError(f"quantization_calibration: fewer than {WINDOW} tokens of text")
    return torch.tensor(ids[:windows * WINDOW]).reshape(windows, WINDOW)


@torch.inference_mode()
def calibrate(model: nn.Module, config: EngineConfig) -> None:
    """Quantize every AWQ layer of `model` from its inputs on the calibration text."""
    # A pre-quantized checkpoint's AWQ layers hold their codes already.
    layers = {name: m for name, m in model.named_modules()
              if isinstance(m, Linear) and isinstance(m.method, AwqLinearMethod)
              and not hasattr(m, "quantized")}
    if not layers:
        return
    start = time.perf_counter()
    windows = calibration_windows(config)
    positions = torch.arange(WINDOW).repeat(WINDOWS_PER_FORWARD)
    with record_inputs(layers) as stats:
        for first in range(0, windows.shape[0], WINDOWS_PER_FORWARD):
            ids = windows[first:first + WINDOWS_PER_FORWARD].reshape(-1)
            hidden = model(ids, positions[:ids.numel()], window_attention(WINDOW))
            model.compute_logits(hidden[::LM_HEAD_STRIDE])
    for name, layer in layers.items():
        layer.method.calibrate(layer, stats[name])
    logger.info("awq: %d layers calibrated on %d tokens in %.1f s", len(layers),
                windows.numel(), time.perf_counter() - start)
