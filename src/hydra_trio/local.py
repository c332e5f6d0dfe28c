"""Run engines inside the current trio program (examples, benchmarks, tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import trio

from .app import serve
from .config import Settings
from .serving import Endpoints


@asynccontextmanager
async def local_engines(*settings: Settings) -> AsyncIterator[list[Endpoints]]:
    """Start one engine per Settings (ports 0 = ephemeral); stop them all on exit."""
    async with trio.open_nursery() as nursery:
        endpoints = [await nursery.start(serve, s) for s in settings]
        try:
            yield endpoints
        finally:
            nursery.cancel_scope.cancel()


def local_settings(model: str | None, **overrides: object) -> Settings:
    base = Settings(model=model, port=0, rpc_port=0, log_level="WARNING")
    return replace(base, **overrides)  # type: ignore[arg-type]
