"""vllm-router, the real binary, as a subprocess of a test (tests/system/test_router_*.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from helpers import free_port, wait_until


def _router_binary() -> str | None:
    beside = Path(sys.executable).parent / "vllm-router"  # the venv's console script
    return str(beside) if beside.exists() else shutil.which("vllm-router")


ROUTER = _router_binary()
needs_router = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (pip install vllm-router)")


class Router:
    def __init__(self, port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=90.0)

    def applied_seq(self, worker_url: str) -> int:
        """The highest KV event seq the router's index applied from ``worker_url`` (its
        debug log says so for each batch, live or replayed); -1: none yet."""
        text = _ANSI.sub("", self.log.read_text(errors="replace"))
        seqs = [
            int(m.group(1))
            for line in text.splitlines()
            if "sequence advanced" in line and f"source={worker_url} " in line
            for m in [re.search(r"\bseq=(\d+)", line)]
            if m
        ]
        return max(seqs, default=-1)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


async def launch_router(nursery: trio.Nursery, log_dir: Path, args: list[str]) -> Router:
    """Start vllm-router with ``args`` (plus host, ports and debug logging) and wait until it
    is ready; cancelling ``nursery`` kills it (trio.run_process's cancellation)."""
    assert ROUTER is not None
    port = free_port()
    log = log_dir / f"router-{port}.log"
    cmd = [
        ROUTER,
        *args,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--prometheus-port", str(free_port()),  # its own exporter; the default may be taken
        "--log-level", "debug",
    ]  # fmt: skip
    out = log.open("wb")
    nursery.start_soon(partial(trio.run_process, cmd, check=False, stdout=out, stderr=subprocess.STDOUT))
    router = Router(port, log)

    async def ready() -> bool:
        try:
            async with router.client() as c:
                return (await c.get("/readiness")).status_code == 200
        except httpx.TransportError:
            return False

    try:
        await wait_until(ready, 60.0)
    except trio.TooSlowError:
        raise AssertionError("vllm-router did not become ready:\n" + log.read_text()[-3000:]) from None
    return router
