"""A fleet across hosts (issue 42 item 6): a prefill and a decode engine, each in its own
network namespace on a link-local segment (benchmarks/netns.py), with vllm-router in the
test's namespace doing P/D between them. The hand-off goes over TCP between the hosts,
never through shared memory (``ip netns exec`` shares /dev/shm, so only the namespace check
of handoff/shm.py keeps it off), and the text is the text of one engine alone.

Skipped where namespaces cannot be made (not root, no iproute2): CI may not be root."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from benchmarks.netns import Fabric, NetnsEngine, available

from routers import launch_router, needs_router

_why = available()
pytestmark = [needs_router, pytest.mark.skipif(_why is not None, reason=_why or "")]

PROMPT = [{"role": "user", "content": "the slot cache engine moves its keys " * 12}]
N = 12


@pytest.fixture
def fleet(tiny_model_ctx: Path, tmp_path: Path) -> Iterator[tuple[Fabric, NetnsEngine, NetnsEngine]]:
    with Fabric(2) as fabric:
        net = f"{fabric.caller_addr.rsplit('.', 1)[0]}.0/24"
        engines = [
            NetnsEngine(h, str(tiny_model_ctx), net, tmp_path, name, extra=("--slots", "2", "--ctx-size", "1024"))
            for h, name in zip(fabric.hosts, ("prefill", "decode"), strict=True)
        ]
        try:
            for e in engines:
                e.start()
            yield fabric, engines[0], engines[1]
        finally:
            for e in engines:
                e.stop()


def _chat(url: str) -> dict[str, Any]:
    r = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": PROMPT, "max_tokens": N, "temperature": 0}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()


async def test_pd_across_namespaces_goes_over_tcp(
    fleet: tuple[Fabric, NetnsEngine, NetnsEngine], nursery: trio.Nursery, tmp_path: Path
) -> None:
    _fabric, prefill, decode = fleet
    # One engine alone (the prefill one: the decode engine stays fresh, nothing to reuse).
    reference = (await trio.to_thread.run_sync(_chat, prefill.url))["choices"][0]["message"]["content"]
    router = await launch_router(
        nursery,
        tmp_path,
        [
            "--vllm-pd-disaggregation",
            "--prefill", prefill.url,
            "--decode", decode.url,
            "--policy", "round_robin",
            "--disable-retries",
        ],
    )  # fmt: skip
    async with router.client() as c:
        r = await c.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": N, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == reference
    transfer = body.get("kv_transfer", {})
    assert transfer.get("status") == "restored", (transfer, decode.log_path.read_text()[-2000:])
    assert transfer.get("transport") == "tcp"  # another host: never the shared-memory file
