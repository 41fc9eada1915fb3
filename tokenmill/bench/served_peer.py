"""tokenmill itself as a peer: `tokenmill serve` in its own process, driven over HTTP by
the same load generator as llama.cpp's and vLLM's servers.

`tokenmill bench compare` runs its configs in-process (no HTTP, no event loop); the
peers it compares them with are servers, and a served engine also pays for its
requests' HTTP, its event loop and the load generator sharing the cores. The
`tokenmill-serve` peer serves the compare's first config (the same engine options,
passed as command-line flags) so that the report holds the served figure beside the
in-process one and beside the peers' served figures, every one measured alike.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from tokenmill.bench.peers import ServerPeer


def engine_flags(options: Mapping[str, Any]) -> list[str]:
    """EngineConfig options (field name -> value) as `tokenmill serve` flags: booleans
    as --name / --no-name, None left out (the field's default)."""
    flags: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


class TokenmillServePeer(ServerPeer):
    name = "tokenmill-serve"
    served_name = "peer-model"

    def __init__(self) -> None:
        self.options: dict[str, Any] = {}  # the engine options to serve (compare sets them)

    def detect(self) -> str | None:
        import tokenmill

        return f"tokenmill {getattr(tokenmill, '__version__', '')} serve ({sys.executable})"

    def server_command(self, model_dir: str, port: int, max_concurrency: int, threads: int,
                       max_model_len: int) -> tuple[list[str], dict[str, str]]:
        # The very engine the compare runs in-process (its options, its thread count):
        # what differs is the serving alone.
        options = {"model": str(model_dir), "num_threads": threads, **self.options}
        return ([sys.executable, "-m", "tokenmill", "serve", *engine_flags(options),
                 "--host", "127.0.0.1", "--port", str(port),
                 "--served-model-name", self.served_name, "--log-level", "warning"], {})
