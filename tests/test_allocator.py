"""Freed activation memory kept for the next step: page faults, and who decides."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from tokenmill.config import EngineConfig
from tokenmill.layers import allocator

# Steps of twelve 8 MB activations, each written, all freed at the step's end (through
# malloc itself: nothing else allocates between them): the page faults of the steps
# after the first two.
STEPS = """
import ctypes, resource, sys
from tokenmill.layers import allocator
if sys.argv[1] == "retain":
    assert allocator.retain_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
def step():
    held = [libc.malloc(8 * 2**20) for _ in range(12)]
    for block in held:
        ctypes.memset(block, 1, 8 * 2**20)
    for block in reversed(held):
        libc.free(block)
step()
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    env = {"PATH": "/usr/bin:/bin"}  # none of glibc's malloc tunables, no preload
    done = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True,
                          text=True, check=True, env=env)
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_retained_memory_is_not_faulted_in_again():
    # glibc's default gives the freed top of the heap back and faults it in again
    # every step (96 MB: ~24,000 pages a step); retained, the pages stay.
    assert faults("default") > 3 * 10_000
    assert faults("retain") < 1_000


def test_the_users_own_malloc_settings_and_allocators_win():
    if platform.libc_ver()[0] == "glibc":
        assert allocator.why_not({}) is None
    assert allocator.why_not({"MALLOC_TRIM_THRESHOLD_": "0"}) in (
        "MALLOC_TRIM_THRESHOLD_ is set", "not glibc")
    assert allocator.why_not({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) in (
        "GLIBC_TUNABLES is set", "not glibc")
    assert allocator.why_not({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}) in (
        "tcmalloc is preloaded", "not glibc")


def test_the_switch_is_a_checked_config_field():
    assert EngineConfig.from_kwargs(model="m").model.retain_freed_memory is True
    with pytest.raises(ValueError, match="retain_freed_memory"):
        EngineConfig.from_kwargs(model="m", retain_freed_memory="yes")
