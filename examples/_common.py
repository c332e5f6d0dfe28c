"""Shared by the examples: connect to running engines, or start local ones."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineAddress:
    host: str
    http_port: int
    rpc_port: int

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"


def parse_address(text: str) -> EngineAddress:
    """HOST:HTTP_PORT:RPC_PORT, e.g. 127.0.0.1:8080:9504."""
    host, http_port, rpc_port = text.rsplit(":", 2)
    return EngineAddress(host, int(http_port), int(rpc_port))


def add_engine_args(parser: argparse.ArgumentParser, names: list[str]) -> None:
    for name in names:
        parser.add_argument(
            f"--{name}",
            type=parse_address,
            default=None,
            help=f"engine {name.upper()} as HOST:HTTP_PORT:RPC_PORT (default: start one in-process)",
        )
    parser.add_argument("--model", default=None, help="GGUF for in-process engines (default: synthetic demo model)")


@asynccontextmanager
async def engines(
    given: list[EngineAddress | None], model: str | None, **overrides: object
) -> AsyncIterator[list[EngineAddress]]:
    """The given addresses, with in-process engines started for the missing ones."""
    missing = [i for i, a in enumerate(given) if a is None]
    if not missing:
        yield [a for a in given if a is not None]
        return
    from hydra_trio.local import local_engines, local_settings

    settings = [local_settings(model, **overrides) for _ in missing]
    async with local_engines(*settings) as started:
        out = list(given)
        for i, ep in zip(missing, started, strict=True):
            out[i] = EngineAddress("127.0.0.1", ep.http_port, ep.rpc_port)
        yield [a for a in out if a is not None]
