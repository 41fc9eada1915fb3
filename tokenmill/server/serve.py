"""run_server: load the engine, serve the app with uvicorn, shut down gracefully.

SIGTERM or SIGINT starts a drain: the server keeps listening, but new requests get
503 with Retry-After (and /health 503) while in-flight requests get the grace period
to finish; those still running then end with an error their clients see (a JSON 503,
or a stream's error event and [DONE]), and the process exits with status 0, within
about a second of the grace period. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from pathlib import Path

import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.engine import LLMEngine
from tokenmill.server.app import DEFAULT_MAX_BODY_BYTES, build_app

logger = logging.getLogger("tokenmill.server")

API_KEY_ENV = "TOKENMILL_API_KEY"
# After the drain: how long connections get to send their last bytes.
CLOSE_TIMEOUT_S = 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with a drain before it closes its socket (see the module
    docstring); uvicorn's own shutdown then only closes finished connections."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncLLMEngine,
                 grace_s: float) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.grace_s = grace_s
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_task is not None or self._loop is None:
            self.should_exit = True  # a second signal: stop now
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        logger.info("draining: %d sequences in flight, %.0f s grace",
                    self.async_engine.num_in_flight, self.grace_s)
        await self.async_engine.shutdown(self.grace_s)
        self.should_exit = True


def run_server(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, served_model_name: str | None = None,
               max_queue: int = 64, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               shutdown_grace_s: float = 10.0, log_level: str = "info",
               default_thinking_budget: int | None = None, stream_interval: int = 1) -> None:
    """Serve until SIGTERM/SIGINT. The API key falls back to $TOKENMILL_API_KEY."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = resolve_api_key(api_key)
    name = served_model_id(config, served_model_name)
    engine = LLMEngine(config, progress=False)
    async_engine = AsyncLLMEngine(engine, max_queue=max_queue, stream_interval=stream_interval)
    app = build_app(async_engine, name, api_key=api_key, max_body_bytes=max_body_bytes,
                    shutdown_grace_s=shutdown_grace_s,
                    default_thinking_budget=default_thinking_budget)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                               timeout_graceful_shutdown=CLOSE_TIMEOUT_S, lifespan="on")
    server = DrainingServer(uv_config, async_engine, shutdown_grace_s)
    # Everything built so far (torch, transformers, the model, the engine) lives until
    # exit: moved out of the collector's reach, later collections do not rescan it, and
    # the exit does not spend ~1 s in a last collection over it (measured: SIGTERM to
    # exit 1.7-1.9 s -> 0.8-0.9 s with a 0.5 s grace).
    gc.freeze()
    # uvicorn re-raises the signal that stopped it once it has shut down; these
    # handlers absorb that, so a graceful stop exits with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    asyncio.run(_serve(server, name, host, port, api_key is not None))
    logger.info("tokenmill server stopped")


def served_model_id(config: EngineConfig, served_model_name: str | None = None) -> str:
    """The id clients send as `model`: the given name, else the model directory's name
    (`pycoder`, not the directory's absolute path)."""
    return served_model_name or Path(config.model.model).name


def resolve_api_key(api_key: str | None) -> str | None:
    """The key to require: the argument, else $TOKENMILL_API_KEY, else none."""
    return api_key or os.environ.get(API_KEY_ENV) or None


async def _serve(server: uvicorn.Server, name: str, host: str, port: int, auth: bool) -> None:
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        logger.info("tokenmill server ready: model %r at http://%s:%d (auth %s)",
                    name, host, port, "on" if auth else "off")
    await task
