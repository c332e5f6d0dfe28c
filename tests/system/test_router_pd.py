"""vllm-router in P/D mode (``--vllm-pd-disaggregation``) over two hydra engines: the real
router binary as a subprocess, the engines in-process. The router asks the prefill engine
for one token with ``kv_transfer_params.do_remote_decode``, copies the reply's
``kv_transfer_params`` into the request it sends to the decode engine, and streams that
engine's answer back."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from helpers import (
    ENGINE,
    assert_server_healthy,
    chat_text,
    gate,
    http,
    scrape,
    stream_then_hang_up,
    wait_until,
)
from routers import Router, launch_router, needs_router

N = 12
PROMPT = [{"role": "user", "content": "the slot cache engine moves its keys " * 12}]


pytestmark = needs_router


@pytest.fixture
async def router_over(nursery: trio.Nursery, tmp_path: Path) -> Callable[..., Any]:
    """``await router_over(prefill_ep, decode_ep)`` -> Router, ready; killed at teardown."""

    async def start(prefill: Any, decode: Any) -> Router:
        args = [
            "--vllm-pd-disaggregation",
            "--prefill", f"http://127.0.0.1:{prefill.http_port}",
            "--decode", f"http://127.0.0.1:{decode.http_port}",
            "--policy", "round_robin",
            "--disable-retries",
        ]  # fmt: skip
        return await launch_router(nursery, tmp_path, args)

    return start


@pytest.fixture
async def engines(start_engine: Callable[..., Any], tiny_model_ctx: Path) -> AsyncIterator[tuple[Any, Any]]:
    a = await start_engine(tiny_model_ctx, **ENGINE, kv_export_ttl_s=0.5)
    b = await start_engine(tiny_model_ctx, **ENGINE)
    yield a, b


def prompt_work(m: dict[Any, float]) -> float:
    return m.get(("hydra_engine_prompt_tokens_processed_total", ()), 0.0)


async def through_router(r: Router, *, stream: bool) -> tuple[str, dict[str, Any]]:
    async with r.client() as c:
        return await chat_text(c, stream=stream, messages=PROMPT, max_tokens=N, temperature=0)


async def reference_text(ep: Any) -> str:
    async with http(ep) as c:
        r = await c.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": N, "temperature": 0})
        assert r.status_code == 200
        return r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_pd_through_vllm_router(
    engines: tuple[Any, Any],
    router_over: Callable[..., Any],
    start_engine: Callable[..., Any],
    tiny_model_ctx: Path,
    stream: bool,
) -> None:
    a, b = engines
    reference = await reference_text(await start_engine(tiny_model_ctx, **ENGINE))  # one engine alone
    router = await router_over(a, b)
    async with http(b) as cb:
        before = await scrape(cb)
        text, final = await through_router(router, stream=stream)
        after = await scrape(cb)
    assert text == reference
    # The decode engine restored the prompt and computed (at most 2, here 0) prompt tokens.
    assert prompt_work(after) - prompt_work(before) <= 2
    assert prompt_work(after) - prompt_work(before) == 0
    assert after[("hydra_kv_pulls_total", (("outcome", "restored"), ("reason", "")))] == 1
    assert final["kv_transfer"]["status"] == "restored"
    assert len(a.state.exports) == 0  # released once pulled
    await assert_server_healthy(a)
    await assert_server_healthy(b)


async def test_router_lease_expiry_falls_back(engines: tuple[Any, Any], router_over: Callable[..., Any]) -> None:
    a, b = engines
    reference = await reference_text(b)
    router = await router_over(a, b)
    exports = a.state.exports
    async with gate(b) as g, trio.open_nursery() as nursery:
        # The decode engine cannot even tokenize until the export's lease (0.5 s) has ended.
        result: dict[str, Any] = {}

        async def call() -> None:
            result["text"], result["final"] = await through_router(router, stream=False)

        nursery.start_soon(call)
        await g.wait_queued(1)
        assert len(exports) == 1
        with trio.fail_after(10):
            while len(exports):
                await exports.wait_changed()
        g.open()
    assert result["text"] == reference
    kv = result["final"]["kv_transfer"]
    assert kv["status"] == "fallback" and kv["reason"] == "not_found", kv
    async with http(a) as ca:
        assert (await scrape(ca))[("hydra_kv_exports_total", (("outcome", "expired"),))] == 1


async def test_router_unreachable_prefill_rpc_falls_back(
    start_engine: Callable[..., Any], tiny_model_ctx: Path, router_over: Callable[..., Any]
) -> None:
    # The prefill engine advertises an address nothing listens on (its RPC binds 127.0.0.1).
    a = await start_engine(tiny_model_ctx, **ENGINE, advertise_host="127.0.0.2")
    b = await start_engine(tiny_model_ctx, **ENGINE, kv_pull_timeout_s=1.0)  # a failed pull answers then
    reference = await reference_text(b)
    router = await router_over(a, b)
    async with http(b) as cb:
        text, final = await through_router(router, stream=True)
        m = await scrape(cb)
    assert text == reference
    assert final["kv_transfer"]["reason"] == "pull_failed"  # one reason for every network failure
    assert m[("hydra_kv_pulls_total", (("outcome", "fallback"), ("reason", "pull_failed")))] == 1


async def test_router_client_leaving_mid_stream_leaves_both_idle(
    engines: tuple[Any, Any], router_over: Callable[..., Any]
) -> None:
    a, b = engines
    router = await router_over(a, b)
    generated_before = b.state.engine._core.tokens_generated
    req = {"messages": PROMPT, "max_tokens": 1800, "temperature": 0}
    async with router.client() as c:
        await stream_then_hang_up(c, "/v1/chat/completions", req, 3)
    # The router drops its upstream request; the decode engine stops and frees the slot.
    await wait_until(lambda: not any(s.busy for s in b.state.engine._core.slots.slots), 20.0)
    await assert_server_healthy(b)
    await assert_server_healthy(a)
    assert len(a.state.exports) == 0
    assert b.state.engine._core.tokens_generated - generated_before < 1800
