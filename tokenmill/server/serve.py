"""run_server: load the engine, serve the app with uvicorn, shut down gracefully.

SIGTERM or SIGINT stops accepting connections, lets in-flight requests finish for
the grace period, aborts the rest, and returns normally (exit status 0).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.engine import LLMEngine
from tokenmill.server.app import DEFAULT_MAX_BODY_BYTES, build_app

logger = logging.getLogger("tokenmill.server")

API_KEY_ENV = "TOKENMILL_API_KEY"


def run_server(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, served_model_name: str | None = None,
               max_queue: int = 64, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               shutdown_grace_s: float = 10.0, log_level: str = "info") -> None:
    """Serve until SIGTERM/SIGINT. The API key falls back to $TOKENMILL_API_KEY."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = resolve_api_key(api_key)
    name = served_model_name or config.model.model
    engine = LLMEngine(config, progress=False)
    async_engine = AsyncLLMEngine(engine, max_queue=max_queue)
    app = build_app(async_engine, name, api_key=api_key, max_body_bytes=max_body_bytes,
                    shutdown_grace_s=shutdown_grace_s)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                               timeout_graceful_shutdown=max(1, round(shutdown_grace_s)),
                               lifespan="on")
    server = uvicorn.Server(uv_config)
    # uvicorn re-raises the signal that stopped it once it has shut down; these
    # handlers absorb that, so a graceful stop exits with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    asyncio.run(_serve(server, name, host, port, api_key is not None))
    logger.info("tokenmill server stopped")


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
