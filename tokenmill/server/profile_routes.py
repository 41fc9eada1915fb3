"""POST /start_profile and /stop_profile: trace the serving engine's steps on demand.

The tracer is attached from the event loop while the engine thread may be mid-step;
the tracer ignores marks of a step it did not see begin, so the first and last
steps of a window can be missing, never malformed.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from pathlib import Path

from fastapi import APIRouter

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.profile.summary import summarize_steps
from tokenmill.profile.tracer import ProfileError, StepTracer
from tokenmill.server.errors import APIError

PROFILE_DIR_ENV = "TOKENMILL_PROFILE_DIR"


def profile_dir() -> Path:
    default = Path(tempfile.gettempdir()) / "tokenmill-profiles"
    return Path(os.environ.get(PROFILE_DIR_ENV) or default)


def add_profile_routes(router: APIRouter, async_engine: AsyncLLMEngine) -> None:
    state: dict[str, StepTracer] = {}

    @router.post("/start_profile")
    async def start_profile() -> dict:
        if "tracer" in state:
            raise APIError(400, "a profile is already running; POST /stop_profile first")
        try:
            state["tracer"] = StepTracer().attach(async_engine.engine)
        except ProfileError as exc:
            raise APIError(400, str(exc)) from None
        return {"status": "started"}

    @router.post("/stop_profile")
    async def stop_profile() -> dict:
        tracer = state.pop("tracer", None)
        if tracer is None:
            raise APIError(400, "no profile is running; POST /start_profile first")
        tracer.detach(async_engine.engine)
        # Unique even for two profiles stopped in the same second.
        name = f"trace-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path = tracer.write(profile_dir() / f"{name}.json")
        return {"status": "stopped", "trace_path": str(path),
                "summary": summarize_steps(tracer.steps).to_json()}
