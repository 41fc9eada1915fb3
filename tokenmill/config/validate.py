"""The one check every config part uses: a ValueError naming the field and what it
allows."""

from __future__ import annotations

from typing import Any


def require(ok: bool, name: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
