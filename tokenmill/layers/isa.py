"""Running as if on a host without AVX-512: `tokenmill --isa avx2 ...` (or
TOKENMILL_ISA=avx2 in the environment).

Hosts differ: some have AVX-512, some only AVX2, and a default chosen on one is not
known to be right on the other. Where no AVX2-only host is at hand, an AVX-512 host can
run every kernel the way an AVX2 host would: tokenmill's own kernels are compiled
without AVX-512 (their AVX2 paths: 6-row x half-block product tiles, the plain decode
fold), and the libraries beneath are capped by their own switches (PyTorch's vectorised
operators, oneDNN, MKL, NumPy's OpenBLAS). Every measured choice and compiled kernel is keyed by the
cap (`cpu_signature`), so a capped tune never overwrites the host's own. What this
cannot change is the hardware under the instructions (cores, caches, memory): on a CPU
that splits 512-bit operations into two 256-bit halves (AMD Zen 4) AVX2 code loses
little arithmetic rate, so figures taken this way test the AVX2 code paths and the
choices made between them, not an AVX2 machine's speed.
"""

from __future__ import annotations

import os

VARIABLE = "TOKENMILL_ISA"

# The libraries' own caps, read once when each loads (so set before torch is imported).
LIBRARY_CAPS = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",     # PyTorch's vectorised CPU operators
        "ONEDNN_MAX_CPU_ISA": "AVX2",      # oneDNN (torch's mkldnn products)
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL (torch's BLAS)
        "OPENBLAS_CORETYPE": "Haswell",    # NumPy's OpenBLAS (its AVX2 kernels)
    },
}
CHOICES = ("native", *LIBRARY_CAPS)

# tokenmill's kernels: compiled for this CPU, less what the cap takes away.
KERNEL_FLAGS = {"avx2": ("-mno-avx512f",)}

# The llama.cpp peer under the cap: its own build (build-avx2) with the AVX2 set and no
# AVX-512, in place of GGML_NATIVE (which would take every instruction the host has).
LLAMACPP_CMAKE = {"avx2": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
                           "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
                           "-DGGML_AVX512=OFF")}


def llamacpp_build_name() -> str:
    """The llama.cpp peer's build directory name for this process's cap."""
    isa = capped_isa()
    return f"build-{isa}" if isa else "build"


def capped_isa() -> str | None:
    """The instruction set the process is capped at (TOKENMILL_ISA), None for native."""
    value = os.environ.get(VARIABLE, "native").strip().lower() or "native"
    if value not in CHOICES:
        raise ValueError(f"{VARIABLE}={value!r}: expected one of {', '.join(CHOICES)}")
    return None if value == "native" else value


def kernel_flags() -> tuple[str, ...]:
    """Extra compiler flags for tokenmill's kernels under the cap."""
    isa = capped_isa()
    return KERNEL_FLAGS[isa] if isa else ()


def capped_environment(isa: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with `isa`'s caps set (and, for
    native, any cap this module sets taken away)."""
    if isa not in CHOICES:
        raise ValueError(f"--isa {isa!r}: expected one of {', '.join(CHOICES)}")
    env = dict(os.environ if base is None else base)
    for caps in LIBRARY_CAPS.values():
        for key, value in caps.items():
            if env.get(key) == value:
                del env[key]
    env.pop(VARIABLE, None)
    if isa != "native":
        env[VARIABLE] = isa
        env.update(LIBRARY_CAPS[isa])
    return env


def split_isa_argument(argv: list[str]) -> tuple[str | None, list[str]]:
    """A leading `--isa X` / `--isa=X` of the command line, and the rest of it."""
    if argv[:1] == ["--isa"]:
        if len(argv) < 2:
            raise ValueError(f"--isa needs a value: one of {', '.join(CHOICES)}")
        return argv[1], argv[2:]
    if argv and argv[0].startswith("--isa="):
        return argv[0].split("=", 1)[1], argv[1:]
    return None, argv


def needs_restart(isa: str, env: dict[str, str] | None = None) -> bool:
    """Whether the process must start again for `isa`'s caps to reach the libraries
    (they read their switches when they load)."""
    current = dict(os.environ if env is None else env)
    return capped_environment(isa, current) != current


if __name__ == "__main__":
    # `env $(python -m tokenmill.layers.isa avx2) python benchmarks/...`: a script run
    # with the caps (the `tokenmill` command takes --isa itself).
    import sys

    names = sys.argv[1:] or ["avx2"]
    caps = capped_environment(names[0], {})
    print(" ".join(f"{key}={value}" for key, value in caps.items()))
