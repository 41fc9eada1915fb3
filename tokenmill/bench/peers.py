"""Peer engines run on the same model and workload as tokenmill.

- transformers: static-batch `generate` in this process (already installed);
- llamacpp: llama.cpp's `llama-server`, on a GGUF converted from the same checkpoint;
- vllm: vLLM's OpenAI server from its own venv.
The two servers live under ~/.cache/tokenmill/peers/ (see `tokenmill bench peers
install`), never in tokenmill's venv, and are driven through the same load generator
as tokenmill's own server. A peer that is not installed is skipped with a message.
tokenmill's own server as a peer: served_peer.py; the registry by name: peer_registry.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import httpx

from tokenmill.bench.driver import EngineRun
from tokenmill.bench.metrics import RequestRecord
from tokenmill.bench.peer_install import PEERS_DIR, vllm_preloads
from tokenmill.bench.workload import WorkloadRequest
from tokenmill.layers.isa import llamacpp_build_name

# Runs llama.cpp's convert_hf_to_gguf.py (argv[1]) with its remaining arguments. The
# converter recognises a BPE tokenizer's pre-tokenizer by hashing how it splits a
# probe text and refuses unknown ones; local tokenizers (the benchmarks' byte-level
# BPE) are unknown to it, so an unrecognised one is declared GPT-2 style. Prompts are
# sent as token ids, so this never changes what the benchmark computes.
_CONVERT_ANY_BPE = """
import runpy, sys
from pathlib import Path
converter = sys.argv[1]
sys.path.insert(0, str(Path(converter).parent))
import conversion.base as base
original = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        print('tokenmill: unrecognised BPE pre-tokenizer, declaring it gpt-2', file=sys.stderr)
        return 'gpt-2'
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = sys.argv[1:]
runpy.run_path(converter, run_name='__main__')
"""

class Peer(ABC):
    name: str

    @abstractmethod
    def detect(self) -> str | None:
        """A description of the installed peer (version, path), or None if absent."""

    def describe(self) -> str:
        """How the peer ran, for the report: version and settings (default: detect())."""
        return self.detect() or self.name

    def missing_message(self) -> str:
        return (f"peer {self.name!r} is not installed; `tokenmill bench peers install "
                f"--peer {self.name}` installs it under {PEERS_DIR}")

    def prepare(self, model_dir: str, max_concurrency: int, threads: int,
                max_model_len: int) -> None:
        """Load the model / start the server once, before several runs (default: nothing)."""
        return None

    def close(self) -> None:
        """Stop whatever prepare() started (default: nothing)."""
        return None

    @abstractmethod
    def run(self, model_dir: str, workload: Sequence[WorkloadRequest],
            max_concurrency: int | None, threads: int, progress: bool = True) -> EngineRun:
        """Run the workload; every request arrives at the start of the run."""


def _token_ids(workload: Sequence[WorkloadRequest], tokenizer) -> list[list[int]]:
    return [r.prompt if isinstance(r.prompt, list) else tokenizer(r.prompt)["input_ids"]
            for r in workload]


class TransformersPeer(Peer):
    """HF `generate` on static, left-padded batches; every row runs to the batch's longest
    output, and a row's tokens are stamped when each generation step happens."""

    name = "transformers"

    def __init__(self, batch_size: int = 8) -> None:
        self.batch_size = batch_size
        self._loaded: tuple[tuple[str, str, str], object, object] | None = None
        # Where and in what dtype it runs: `bench compare` sets the engines' own
        # (a GPU run compares on the GPU, in bfloat16 unless told otherwise).
        self.device, self.dtype = "cpu", "float32"

    def detect(self) -> str | None:
        import transformers

        return f"transformers {transformers.__version__} (in-process)"

    def describe(self) -> str:
        return (f"{self.detect()}, {self.device}, {self.dtype}, `generate` on left-padded "
                f"static batches of the concurrency (else {self.batch_size})")

    def _load(self, model_dir: str):
        key = (model_dir, self.device, self.dtype)  # placed again: loaded again
        if self._loaded is None or self._loaded[0] != key:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=getattr(torch, self.dtype)).to(self.device).eval()
            self._loaded = (key, model, AutoTokenizer.from_pretrained(model_dir))
        return self._loaded[1], self._loaded[2]

    def run(self, model_dir: str, workload: Sequence[WorkloadRequest],
            max_concurrency: int | None, threads: int, progress: bool = True) -> EngineRun:
        import torch
        from tqdm.auto import tqdm
        from transformers import LogitsProcessor, LogitsProcessorList

        torch.set_num_threads(threads)
        model, tokenizer = self._load(model_dir)
        prompts = _token_ids(workload, tokenizer)
        batch_size = max_concurrency or self.batch_size
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

        class StepClock(LogitsProcessor):
            def __init__(self) -> None:
                self.times: list[float] = []

            def __call__(self, input_ids, scores):
                self.times.append(time.perf_counter())
                return scores

        records: list[RequestRecord] = []
        start = time.perf_counter()
        for first in tqdm(range(0, len(workload), batch_size), desc="transformers",
                          disable=not progress, leave=False):
            batch = list(range(first, min(first + batch_size, len(workload))))
            width = max(len(prompts[i]) for i in batch)
            ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch],
                               device=self.device)
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i])
                                 for i in batch], device=self.device)
            new_tokens = max(workload[i].max_tokens for i in batch)
            clock = StepClock()
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))
            for i in batch:
                wanted = workload[i].max_tokens
                times = clock.times[:wanted]
                records.append(RequestRecord(f"hf-{i}", len(prompts[i]), start, times,
                                             [1] * len(times), times[-1]))
        return EngineRun(records, time.perf_counter() - start, 0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerPeer(Peer):
    """A peer driven over HTTP: start its server on 127.0.0.1, load it, stop it."""

    start_timeout_s = 120.0
    served_name: str | None = None  # the model name requests must carry, if any
    _process: subprocess.Popen | None = None
    _command: tuple[list[str], dict[str, str]] | None = None  # the last server started
    _log = None
    _url = ""

    @abstractmethod
    def server_command(self, model_dir: str, port: int, max_concurrency: int, threads: int,
                       max_model_len: int) -> tuple[list[str], dict[str, str]]:
        """The command line and extra environment of the server."""

    def prepare(self, model_dir: str, max_concurrency: int, threads: int,
                max_model_len: int) -> None:
        if self._process is not None:
            return
        port = free_port()
        cmd, env = self.server_command(model_dir, port, max_concurrency, threads, max_model_len)
        self._command = cmd, env
        PEERS_DIR.mkdir(parents=True, exist_ok=True)
        self._log = open(PEERS_DIR / f"{self.name}-server.log", "wb")  # noqa: SIM115
        self._process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **env})
        self._url = f"http://127.0.0.1:{port}"
        try:
            self._wait_healthy(self._process, self._url)
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        if self._command is None:
            return super().describe()
        cmd, env = self._command
        settings = " ".join([f"{k}={v}" for k, v in env.items()] + [Path(cmd[0]).name] + cmd[1:])
        return f"{super().describe()}, run as `{settings}`"

    def close(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)
        if self._log is not None:
            self._log.close()
            self._log = None

    def run(self, model_dir: str, workload: Sequence[WorkloadRequest],
            max_concurrency: int | None, threads: int, progress: bool = True) -> EngineRun:
        from tokenmill.bench.serve_load import LoadConfig, run_load

        concurrency = max_concurrency or len(workload)
        started_here = self._process is None
        if started_here:
            max_len = max(r.prompt_len + r.max_tokens for r in workload) + 8
            self.prepare(model_dir, concurrency, threads, max_len)
        try:
            config = LoadConfig(self._url, self.served_name, concurrency=concurrency,
                                num_warmup=0)
            result = asyncio.run(run_load(config, workload, progress=progress))
        finally:
            if started_here:
                self.close()
        return EngineRun(result.records, result.duration_s, 0)

    def _wait_healthy(self, process: subprocess.Popen, url: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with {process.returncode}; "
                                   f"see {PEERS_DIR / (self.name + '-server.log')}")
            try:
                if httpx.get(url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} server was not healthy after {self.start_timeout_s} s")


class LlamaCppPeer(ServerPeer):
    name = "llamacpp"

    OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # what its converter writes

    def __init__(self, outtype: str = "f32") -> None:
        if outtype not in self.OUTTYPES:
            raise ValueError(f"llamacpp: no GGUF type {outtype!r}; choose from {self.OUTTYPES}")
        self.outtype = outtype  # GGUF weight type
        self.root = PEERS_DIR / "llamacpp"
        if outtype != "f32":  # reports name the format: llamacpp-q8_0
            self.name = f"llamacpp-{outtype}"

    @property
    def server_binary(self) -> Path | None:
        built = self.root / llamacpp_build_name() / "bin" / "llama-server"
        if built.is_file():
            return built
        found = shutil.which("llama-server")
        return Path(found) if found else None

    @property
    def converter(self) -> Path | None:
        found = sorted(self.root.glob("src/*/vendor/llama.cpp/convert_hf_to_gguf.py"))
        return found[0] if found else None

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    def detect(self) -> str | None:
        if self.server_binary is None or self.converter is None or not self.python.is_file():
            return None
        return f"llama.cpp llama-server at {self.server_binary}"

    def gguf_path(self, model_dir: str) -> Path:
        """Convert the checkpoint once (cached by directory name and mtime)."""
        source = Path(model_dir).resolve()
        stamp = int((source / "config.json").stat().st_mtime)
        out = PEERS_DIR / "gguf" / f"{source.name}-{stamp}-{self.outtype}.gguf"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([str(self.python), "-c", _CONVERT_ANY_BPE, str(self.converter),
                            str(source), "--outfile", str(out), "--outtype", self.outtype],
                           check=True)
        return out

    def server_command(self, model_dir: str, port: int, max_concurrency: int, threads: int,
                       max_model_len: int) -> tuple[list[str], dict[str, str]]:
        # -c is the total context, shared by the -np parallel slots.
        return ([str(self.server_binary), "-m", str(self.gguf_path(model_dir)),
                 "--host", "127.0.0.1", "--port", str(port), "-np", str(max_concurrency),
                 "-c", str(max_model_len * max_concurrency), "-t", str(threads),
                 "--no-webui"], {})


class VllmPeer(ServerPeer):
    name = "vllm"
    served_name = "peer-model"
    start_timeout_s = 900.0  # the CPU backend compiles for minutes at start-up

    def __init__(self) -> None:
        self.venv = PEERS_DIR / "vllm" / "venv"

    def detect(self) -> str | None:
        python = self.venv / "bin" / "python"
        installed = list(self.venv.glob("lib/python*/site-packages/vllm*.dist-info"))
        if not python.is_file() or not installed:
            return None
        return f"{installed[0].name.removesuffix('.dist-info')} in {self.venv}"

    def server_command(self, model_dir: str, port: int, max_concurrency: int, threads: int,
                       max_model_len: int) -> tuple[list[str], dict[str, str]]:
        # The CPU backend's documented settings: KV cache space in GiB, its OpenMP
        # workers bound one per core (VLLM_CPU_OMP_THREADS_BIND) and its preloaded
        # allocator and OpenMP (`vllm_preloads`); our own environment's values win.
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
               "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                           f"0-{threads - 1}"),
               "OMP_NUM_THREADS": str(threads)}
        preload = os.environ.get("LD_PRELOAD") or ":".join(vllm_preloads(self.venv))
        if preload:
            env["LD_PRELOAD"] = preload
        return ([str(self.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                 "--model", str(model_dir), "--served-model-name", self.served_name,
                 "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                 "--max-model-len", str(max_model_len),
                 "--max-num-seqs", str(max_concurrency)], env)

    def describe(self) -> str:
        described = super().describe()
        env = self._command[1] if self._command else None  # the server it last started
        missing = [name for name in ("libtcmalloc", "libiomp")
                   if env is not None and name not in env.get("LD_PRELOAD", "")]
        if missing:  # the report says the peer ran short of its guide's settings
            described += (f"; not preloaded, as vLLM's CPU guide asks: {', '.join(missing)}"
                          " (libtcmalloc: apt install libtcmalloc-minimal4)")
        return described
