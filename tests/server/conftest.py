"""Real server processes for the HTTP tests, started on free ports of 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MODEL_NAME = "tiny-llama"
START_TIMEOUT_S = 90.0


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None = None
    extra: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_dir: Path, log_dir: Path, *args: str, api_key: str | None = API_KEY
                 ) -> ServerProcess:
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "tokenmill.server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
           "--num-threads", "1", "--log-level", "warning", *args]
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), TOKENIZERS_PARALLELISM="false")
    env.pop("TOKENMILL_API_KEY", None)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(process, port, log_path, api_key, list(args))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=1.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server did not become healthy in {START_TIMEOUT_S}s:\n{server.log()}")


@pytest.fixture(scope="session")
def server(llama_dir, tmp_path_factory):
    """The shared server: API key on, a 64 KiB body limit."""
    proc = start_server(llama_dir, tmp_path_factory.mktemp("server"), "--max-body-bytes", "65536")
    yield proc
    proc.stop()


@pytest.fixture
def server_factory(llama_dir, tmp_path_factory):
    """Starts extra servers with their own flags; kills them after the test."""
    started: list[ServerProcess] = []

    def start(*args: str, api_key: str | None = API_KEY) -> ServerProcess:
        proc = start_server(llama_dir, tmp_path_factory.mktemp("server"), *args, api_key=api_key)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of a Prometheus sample `name{...}` whose labels include `labels`."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


def wait_for_metric(server: ServerProcess, name: str, predicate, timeout_s: float = 15.0
                    ) -> float | None:
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = metric_value(httpx.get(server.url + "/metrics", timeout=5).text, name)
        if value is not None and predicate(value):
            return value
        time.sleep(0.1)
    return value
