"""`--huge-pages`: weights are advised into transparent huge pages as they load, only
when asked, before anything is written to them, and the system takes the advice."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_madvise_mode = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists()
    or "[madvise]" not in THP.read_text(),
    reason="transparent huge pages are not in madvise mode here")


def eligible(tensor: torch.Tensor) -> bool:
    """THPeligible of the mapping holding the tensor's first byte (/proc/self/smaps)."""
    address, inside = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError("no mapping holds the tensor")


# In a fresh process: in this one, memory an earlier test (or engine) advised and freed
# may stay in the heap (layers/allocator.py keeps freed memory) and serve a later
# allocation, already eligible, so "not asked, not eligible" would depend on the order.
_ELIGIBILITY_CHECK = """
import sys
import torch
from tokenmill.layers import huge_pages
sys.path.insert(0, sys.argv[1])
from test_huge_pages import eligible
# 40 MB: above glibc's largest mmap threshold (32 MB), so each is a fresh mapping.
shape = (10 * 2**20,)
with huge_pages.for_weights(True):
    advised = huge_pages.empty_like(torch.empty(0).new_empty(shape))
    small = huge_pages.empty_like(torch.empty(1000))
with huge_pages.for_weights(False):
    plain = huge_pages.empty_like(torch.empty(0).new_empty(shape))
unasked = huge_pages.empty_like(torch.empty(0).new_empty(shape))  # outside: off
assert eligible(advised)
assert not eligible(plain) and not eligible(unasked)
assert not huge_pages.advise(small)  # under one huge page: not asked
with huge_pages.for_weights(True):
    assert not huge_pages.advise(torch.empty(shape, device="meta"))
"""


@needs_madvise_mode
def test_memory_is_eligible_for_huge_pages_only_when_asked():
    done = subprocess.run([sys.executable, "-c", _ELIGIBILITY_CHECK,
                           str(Path(__file__).parent)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_engine_advises_parameters_and_packed_weights_when_asked(
        llama_dir, monkeypatch, enabled):
    seen: list[tuple[bool, int]] = []  # (asked, elements) per advised tensor
    real = huge_pages.advise

    def recording(tensor):
        seen.append((huge_pages._ENABLED.get(), tensor.numel()))
        return real(tensor)

    monkeypatch.setattr(huge_pages, "advise", recording)
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)  # the tiny model's weights count too
    llm = LLM(str(llama_dir), cpu_blas="native", huge_pages=enabled, progress=False,
              num_threads=1)
    # Every parameter (from the loader) and every packed product weight (from pack).
    linears = sum(1 for m in llm.engine.executor.worker.runner.model.modules()
                  if hasattr(m, "native_weight"))
    assert len(seen) >= linears > 0
    assert all(asked is enabled for asked, _ in seen)
    out = llm.generate(["def f"], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_setting_must_be_a_bool():
    from tokenmill.config import ModelConfig

    with pytest.raises(ValueError, match="huge_pages"):
        ModelConfig(huge_pages=1)
