"""Small C++ kernels compiled for this CPU at first use (`torch.utils.cpp_extension`,
-O3 -march=native, OpenMP on torch's own pool), cached per source, CPU, torch and
Python version; None where nothing can be built (no compiler or headers), so every
caller keeps a plain-PyTorch path."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import platform
from pathlib import Path

import torch

from tokenmill.layers.isa import kernel_flags
from tokenmill.layers.timing import CACHE, cpu_signature

logger = logging.getLogger(__name__)


# Headers that kernels in several folders include (csrc/shared/rotary.h: row_ops and the
# paged decode kernel rotate alike); they travel with every source.
SHARED_HEADERS = Path(__file__).resolve().parent / "csrc" / "shared"


def headers(source: Path) -> list[Path]:
    """The headers beside a source and the shared ones, by name (its `#include "..."`s:
    all are copied beside it to compile; one beside it wins over a shared one of its
    name, so a source copied with its headers elsewhere builds the same)."""
    found = {h.name: h for h in SHARED_HEADERS.glob("*.h")}
    found.update({h.name: h for h in source.parent.glob("*.h")})
    return [found[name] for name in sorted(found)]


def build_key(source: Path, extra_cflags: tuple[str, ...] = ()) -> str:
    # torch's installation path too: its headers' path is part of the build, and
    # torch rebuilds a module whose build dir another environment compiled (two
    # virtual environments would take turns recompiling one directory).
    text = (source.read_text() + "".join(h.read_text() for h in headers(source))
            + torch.__version__ + str(Path(torch.__file__).parent) + cpu_signature()
            + platform.python_version() + " ".join(extra_cflags))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_extension(name: str, source: Path, extra_cflags: tuple[str, ...] = ()):
    """The compiled module for `source` (with extra_cflags beside -O3 -march=native
    -fopenmp, and the instruction-set cap's: tokenmill/layers/isa.py), or None (with a
    warning naming why)."""
    return compiled(name, source, (*extra_cflags, *kernel_flags()))


@functools.cache
def compiled(name: str, source: Path, extra_cflags: tuple[str, ...]):
    try:
        from torch.utils.cpp_extension import load

        key = build_key(source, extra_cflags)
        build_dir = CACHE / "kernels" / f"{name}-{key}"
        if not any(build_dir.glob("*.so")):
            logger.info("compiling the %s kernel for this CPU (once; cached in %s)", name,
                        build_dir)
        build_dir.mkdir(parents=True, exist_ok=True)
        # One compile at a time per kernel, under a lock the OS drops when its holder
        # dies. Holding it, any lock file torch's own build left is from a compile that
        # was killed (a start-up interrupted mid-build), which would make every later
        # start wait on it forever: removed.
        with open(build_dir / "tokenmill.lock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing %s, left by an interrupted build", stale)
                stale.unlink()
            # Compiled from a copy (with its sibling headers) inside the build
            # directory: the same text from another checkout is the same build (torch
            # rebuilds when a source's path changes).
            for original in (source, *headers(source)):
                copy = build_dir / original.name
                if not copy.is_file() or copy.read_text() != original.read_text():
                    copy.write_text(original.read_text())
            # -fopenmp: at::parallel_for runs on torch's own OpenMP pool (the soname
            # libgomp.so.1 resolves to the copy torch has already loaded).
            return load(name=f"tokenmill_{name}_{key}",
                        sources=[str(build_dir / source.name)],
                        extra_cflags=["-O3", "-march=native", "-fopenmp", *extra_cflags],
                        extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                        verbose=False)
    except Exception as exc:  # noqa: BLE001 (any build failure means: fall back)
        logger.warning("native kernel %s could not be compiled (%s); the PyTorch path "
                       "serves instead", name, exc)
        return None


ROW_OPS_SOURCE = Path(__file__).resolve().parent / "csrc" / "row_ops.cpp"
# -ffp-contract=off: products and sums round as torch's. -fno-trapping-math: nothing
# here reads the floating-point exception flags, and without AVX-512's masks GCC will
# not turn silu_mul's range selects into blends while it must keep them (the loop ran
# unvectorized under AVX2, 4-6x slower).
ROW_OPS_FLAGS = ("-ffp-contract=off", "-fno-trapping-math")


@functools.cache  # (no arguments: a lookup per call costs nothing)
def native_row_ops():
    """The compiled per-row operators (csrc/row_ops.cpp: rms_norm, rotate_), or None
    where they cannot be built (flags: ROW_OPS_FLAGS)."""
    return build_extension("row_ops", ROW_OPS_SOURCE, ROW_OPS_FLAGS)


def row_ops_for(*tensors: torch.Tensor):
    """The compiled row operators where they serve these tensors (float32 on the CPU,
    outside autograd), else None; each caller checks the layout its operator needs."""
    if torch.is_grad_enabled():
        return None
    for tensor in tensors:
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            return None
    return native_row_ops()


def prepare_native_row_ops(device: torch.device, dtype: torch.dtype) -> None:
    """Build (or load) the operators at start-up rather than in the first request."""
    if device.type == "cpu" and dtype == torch.float32:
        native_row_ops()
