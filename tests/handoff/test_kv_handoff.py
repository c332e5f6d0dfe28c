"""P/D hand-off through kv_transfer_params, engine to engine (no router): the prefill side
exports under a lease, the decode side pulls over KV_PULL, restores and generates; every
failure falls back to a local prefill with the same text and says why."""

from __future__ import annotations

import copy
import socket
import struct
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from helpers import (
    ENGINE,
    PREFILL_PARAMS,
    assert_error,
    assert_server_healthy,
    chat_text,
    gate,
    http,
    parse_sse,
    rpc,
    scrape,
    stream_then_hang_up,
    wait_until,
)
from hydra_trio.rpc.client import Call, info_call
from hydra_trio.wire import Op, Status
from hydra_trio.wire.kvpull import encode_pull_request

PROMPT = [{"role": "user", "content": "the slot cache engine moves its keys " * 12}]
N = 12


def prompt_computed(m: dict[Any, float]) -> float:
    """Prompt tokens this engine evaluated (all paths) and cached ones reused, on chat."""
    return m.get(("hydra_engine_prompt_tokens_processed_total", ()), 0.0)


async def export(c: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    req = {"messages": PROMPT, "max_tokens": 1, "temperature": 0, "stream": False, **body}
    req.setdefault("kv_transfer_params", PREFILL_PARAMS)
    r = await c.post("/v1/chat/completions", json=req, headers={"X-Request-Id": "test-pd-1"})
    assert r.status_code == 200, r.text
    return r.json()


async def decode(c: httpx.AsyncClient, params: Any, *, stream: bool = False) -> tuple[str, dict[str, Any]]:
    """(text, final object: the completion body, or the last SSE chunk)."""
    return await chat_text(c, stream=stream, messages=PROMPT, max_tokens=N, temperature=0, kv_transfer_params=params)


async def plain(c: httpx.AsyncClient) -> str:
    r = await c.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": N, "temperature": 0})
    assert r.status_code == 200
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture
async def pair(start_engine: Callable[..., Any], tiny_model_ctx: Path) -> tuple[Any, Any]:
    a = await start_engine(tiny_model_ctx, **ENGINE)
    b = await start_engine(tiny_model_ctx, **ENGINE, kv_pull_timeout_s=5.0)  # a failed pull answers then
    return a, b


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_handoff_restores_the_prompt_and_matches_one_engine(pair: tuple[Any, Any], stream: bool) -> None:
    a, b = pair
    async with http(a) as ca, http(b) as cb:
        reference = await plain(ca)
        body = await export(ca)
        # The prefill reply: one token, the export named for the decode engine.
        assert body["usage"]["completion_tokens"] == 1
        params = body["kv_transfer_params"]
        hydra = params["hydra"]
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", a.rpc_port)
        assert hydra["n_past"] == body["usage"]["prompt_tokens"]
        assert hydra["model_name"] == a.state.engine.identity.model_name
        assert body["kv_export"]["exported"] and body["kv_export"]["kv_bytes"] == hydra["kv_bytes"]
        # The slot is free as soon as the reply is out: the export lives in host memory.
        assert not any(s.busy for s in a.state.engine._core.slots.slots)
        assert len(a.state.exports) == 1 and a.state.exports.bytes_held == hydra["kv_bytes"]

        before = await scrape(cb)
        text, final = await decode(cb, params, stream=stream)
        after = await scrape(cb)

    assert text == reference
    n_prompt = hydra["n_past"]
    kv = final["kv_transfer"]
    assert kv["status"] == "restored" and kv["n_restored"] == n_prompt and kv["kv_bytes"] == hydra["kv_bytes"]
    assert final["usage"]["prompt_tokens"] == n_prompt
    assert final["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt
    assert final["timings"]["prompt_n"] == 0  # the first token came from the pulled logits
    # The decode engine computed no prompt token; its counters say so.
    assert prompt_computed(after) - prompt_computed(before) == 0
    chat = (("path", "chat"),)
    assert after[("hydra_prompt_tokens_total", chat)] - before.get(("hydra_prompt_tokens_total", chat), 0) == 0
    assert (
        after[("hydra_cached_prompt_tokens_total", chat)] - before.get(("hydra_cached_prompt_tokens_total", chat), 0)
        == n_prompt
    )
    assert after[("hydra_kv_pulls_total", (("outcome", "restored"), ("reason", "")))] == 1
    # Released once pulled.
    assert len(a.state.exports) == 0 and a.state.exports.bytes_held == 0
    async with http(a) as ca:
        m = await scrape(ca)
    assert m[("hydra_kv_exports_total", (("outcome", "pulled"),))] == 1
    await assert_server_healthy(a)
    await assert_server_healthy(b)


async def test_lease_expires_and_decode_falls_back(start_engine: Callable[..., Any], tiny_model_ctx: Path) -> None:
    a = await start_engine(tiny_model_ctx, **ENGINE, kv_export_ttl_s=0.3)
    b = await start_engine(tiny_model_ctx, **ENGINE)
    exports = a.state.exports
    async with http(a) as ca, http(b) as cb:
        reference = await plain(cb)
        params = (await export(ca))["kv_transfer_params"]
        assert len(exports) == 1
        with trio.fail_after(10):
            while len(exports):  # the lease ends on time, without any access
                await exports.wait_changed()
        assert exports.bytes_held == 0
        text, body = await decode(cb, params)
        m = await scrape(ca)
    assert text == reference
    kv = body["kv_transfer"]
    assert kv["status"] == "fallback" and kv["reason"] == "not_found", kv
    assert (
        body["usage"]["prompt_tokens_details"]["cached_tokens"] < body["usage"]["prompt_tokens"]
        or body["timings"]["prompt_n"] > 0
    )
    assert m[("hydra_kv_exports_total", (("outcome", "expired"),))] == 1


async def test_bounded_exports_evict_the_oldest(start_engine: Callable[..., Any], tiny_model_ctx: Path) -> None:
    a = await start_engine(tiny_model_ctx, **ENGINE)
    b = await start_engine(tiny_model_ctx, **ENGINE)
    async with http(a) as ca:
        size = (await export(ca))["kv_transfer_params"]["hydra"]["kv_bytes"]
    # Room for one export of this prompt, not two.
    a.state.exports.max_bytes = size + size // 2
    async with http(a) as ca, http(b) as cb:
        first = (await export(ca))["kv_transfer_params"]
        second = (await export(ca))["kv_transfer_params"]
        assert len(a.state.exports) == 1 and a.state.exports.bytes_held == size
        _, body1 = await decode(cb, first)
        _, body2 = await decode(cb, second)
        m = await scrape(ca)
    assert body1["kv_transfer"]["reason"] == "not_found"
    assert body2["kv_transfer"]["status"] == "restored"
    assert m[("hydra_kv_exports_total", (("outcome", "evicted"),))] >= 1


async def test_export_larger_than_the_store_is_refused(start_engine: Callable[..., Any], tiny_model_ctx: Path) -> None:
    a = await start_engine(tiny_model_ctx, **ENGINE, kv_export_max_bytes=1000)
    async with http(a) as ca:
        body = await export(ca)
        m = await scrape(ca)
    # No kv_transfer_params: a router then lets the decode engine prefill on its own.
    assert "kv_transfer_params" not in body and body["kv_export"]["exported"] is False
    assert body["usage"]["completion_tokens"] == 1
    assert m[("hydra_kv_exports_total", (("outcome", "refused"),))] == 1
    assert len(a.state.exports) == 0


def _tamper(params: dict[str, Any], how: str) -> dict[str, Any]:
    p = copy.deepcopy(params)
    if how == "pull_failed":
        p["remote_port"] = 1  # nothing listens there
    elif how == "hash_mismatch":
        p["hydra"]["kv_hash"] = "xxh3:0000000000000000"
    elif how == "bad_params":
        p["hydra"]["v"] = 99
    elif how == "identity_mismatch":
        p["hydra"]["tokenizer_hash"] = "xxh3:ffffffffffffffff"
    return p


@pytest.mark.parametrize("how", ["pull_failed", "hash_mismatch", "bad_params", "identity_mismatch"])
async def test_failed_pull_prefills_locally_and_says_why(pair: tuple[Any, Any], how: str) -> None:
    a, b = pair
    async with http(a) as ca, http(b) as cb:
        # The fallback finds the prompt in B's slot (all but its last token, evaluated alone):
        # the reference is a run of that same computation, the second plain one.
        await plain(cb)
        reference = await plain(cb)
        params = _tamper((await export(ca))["kv_transfer_params"], how)
        before = await scrape(cb)
        text, body = await decode(cb, params)
        after = await scrape(cb)
    assert text == reference  # never a 200 with wrong text
    kv = body["kv_transfer"]
    assert kv["status"] == "fallback" and kv["reason"] == how, kv
    assert "detail" not in kv  # a code, never a peer's own words (those go to the log)
    assert after[("hydra_kv_pulls_total", (("outcome", "fallback"), ("reason", how)))] == 1
    assert (
        prompt_computed(after) > prompt_computed(before) or body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    )
    # A pull that did not happen leaves the export to its lease; one that did took it.
    assert len(a.state.exports) == (0 if how == "hash_mismatch" else 1)
    await assert_server_healthy(b)


async def test_export_from_another_model_is_never_restored(
    start_engine: Callable[..., Any], tiny_model_ctx: Path, tiny_model: Path
) -> None:
    a = await start_engine(tiny_model_ctx, **ENGINE)
    b = await start_engine(tiny_model, **ENGINE)  # same tokenizer family, other model
    async with http(a) as ca, http(b) as cb:
        reference = await plain(cb)
        params = (await export(ca))["kv_transfer_params"]
        text, body = await decode(cb, params)
    assert text == reference
    assert body["kv_transfer"]["reason"] == "identity_mismatch"
    assert len(a.state.exports) == 1  # nothing was pulled


async def test_kv_pull_op_refusals(pair: tuple[Any, Any]) -> None:
    a, _ = pair
    async with await rpc(a) as c:
        info = await c.call(info_call())
        assert "kv_pull" in info.meta["capabilities"]
        resp = await c.call(Call(Op.KV_PULL, b"", [encode_pull_request("A" * 22)]), check=False)
        assert_error(resp, Status.NOT_FOUND, "EXPORT_NOT_FOUND")
        resp = await c.call(Call(Op.KV_PULL, b"0", [encode_pull_request("A" * 22)]), check=False)
        assert_error(resp, Status.BAD_REQUEST, "BAD_KEY")
        resp = await c.call(Call(Op.KV_PULL, b"", [b"{" * 5000]), check=False)
        assert_error(resp, Status.BAD_REQUEST, "TOO_LARGE")
        resp = await c.call(Call(Op.KV_PULL, b"", [b'{"export_id": 1}']), check=False)
        assert_error(resp, Status.BAD_REQUEST, "BAD_FRAME")
        assert (await c.info()).ok  # refused payloads were drained: still in step
    async with http(a) as ca:
        params = (await export(ca))["kv_transfer_params"]
    async with await rpc(a) as c:
        export_id = params["hydra"]["export_id"]
        first = await c.call(Call(Op.KV_PULL, b"", [encode_pull_request(export_id)]))
        assert first.meta["kv_hash"] == params["hydra"]["kv_hash"] and len(first.payload) == params["hydra"]["kv_bytes"]
        again = await c.call(Call(Op.KV_PULL, b"", [encode_pull_request(export_id)]), check=False)
        assert_error(again, Status.NOT_FOUND, "EXPORT_NOT_FOUND")  # pulled once


async def test_decode_client_leaving_mid_stream_leaves_both_idle(pair: tuple[Any, Any]) -> None:
    a, b = pair
    async with http(a) as ca, http(b) as cb:
        params = (await export(ca))["kv_transfer_params"]
        req = {"messages": PROMPT, "max_tokens": 4000, "temperature": 0, "kv_transfer_params": params}
        await stream_then_hang_up(cb, "/v1/chat/completions", req, 3)
    await assert_server_healthy(b)
    await assert_server_healthy(a)
    assert len(a.state.exports) == 0


async def test_vllm_gauges_are_measured(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, **ENGINE, slots=1, slot_wait_s=30.0)
    labels = (("engine", "0"), ("model_name", ep.state.engine.identity.model_alias))
    post = "/v1/chat/completions"
    body = {"messages": PROMPT, "max_tokens": 4, "temperature": 0}
    async with http(ep) as c, http(ep) as c2:
        idle = await scrape(c)
        assert idle[("vllm:num_requests_running", labels)] == 0
        assert idle[("vllm:num_requests_waiting", labels)] == 0
        assert idle[("vllm:kv_cache_usage_perc", labels)] == 0
        # Two requests on one slot, advanced one GPU call at a time: the first claims the
        # slot and waits to prefill, the second waits for the slot.
        async with gate(ep) as g, trio.open_nursery() as nursery:
            nursery.start_soon(partial(c.post, post, json=body))
            await g.step(1)  # the first request's tokenize: it claims the slot
            await g.wait_queued(1)  # its first prefill chunk
            nursery.start_soon(partial(c2.post, post, json=body))
            await g.wait_queued(2)  # the second request's tokenize, behind it
            await g.step(2)  # the chunk, then the tokenize: the second now waits for the slot
            await wait_until(lambda: ep.state.engine._core.slots.waiting == 1)
            busy = await scrape(c)
            assert busy[("vllm:num_requests_running", labels)] == 1
            assert busy[("vllm:num_requests_waiting", labels)] == 1
            assert (
                busy[("vllm:kv_cache_usage_perc", labels)]
                == ep.state.engine._core.n_past(0) / ep.state.engine.n_ctx
                > 0
            )
            g.open()
        done = await scrape(c)
    assert done[("vllm:num_requests_running", labels)] == 0
    assert done[("vllm:num_requests_waiting", labels)] == 0
    # The finished requests' KV stays as an evictable prefix cache: not "used".
    assert done[("vllm:kv_cache_usage_perc", labels)] == 0
    # Tokens, as vLLM counts them: two identical prompts, the second found in the slot.
    chat = (("path", "chat"),)
    queries = done[("vllm:prefix_cache_queries_total", labels)]
    hits = done[("vllm:prefix_cache_hits_total", labels)]
    assert queries == done[("hydra_prompt_tokens_total", chat)] + done[("hydra_cached_prompt_tokens_total", chat)]
    assert hits == queries / 2 - 1  # the last prompt token is re-evaluated for its logits


class SilentPeer:
    """A TCP peer that reads the KV_PULL and never answers: how a wedged prefill engine
    looks. Records when the puller hangs up."""

    def __init__(self) -> None:
        self.connected = trio.Event()
        self.hung_up = trio.Event()

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connected.set()
        async with stream:
            while await stream.receive_some(65536):
                pass
        self.hung_up.set()


async def _silent_peer(nursery: trio.Nursery) -> tuple[SilentPeer, int]:
    peer = SilentPeer()
    listeners = await nursery.start(partial(trio.serve_tcp, peer.handle, 0, host="127.0.0.1"))
    return peer, listeners[0].socket.getsockname()[1]


async def test_pull_deadline_falls_back(
    start_engine: Callable[..., Any], tiny_model_ctx: Path, nursery: trio.Nursery
) -> None:
    a = await start_engine(tiny_model_ctx, **ENGINE)
    b = await start_engine(tiny_model_ctx, **ENGINE, kv_pull_timeout_s=0.3)
    peer, port = await _silent_peer(nursery)
    async with http(a) as ca, http(b) as cb:
        reference = await plain(cb)
        params = (await export(ca))["kv_transfer_params"]
        params["remote_port"] = port
        text, body = await decode(cb, params)
    assert text == reference
    assert body["kv_transfer"]["reason"] == "pull_failed"
    with trio.fail_after(5):
        await peer.hung_up.wait()  # the deadline closed the connection
    await assert_server_healthy(b)


async def _talking_peer(nursery: trio.Nursery) -> int:
    """Something else listening (an HTTP server, say): it answers at once, not KV_PULL."""

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.send_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n" * 4)

    listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    return listeners[0].socket.getsockname()[1]


async def test_a_closed_a_silent_and_a_talking_port_look_the_same(
    start_engine: Callable[..., Any], tiny_model_ctx: Path, nursery: trio.Nursery
) -> None:
    """No port scanning through the engine (issue 28, 1.8), where an operator asks for it
    (--kv-pull-uniform-timing): whatever is at the address a client names, the reply says
    ``pull_failed`` and comes no sooner than the pull's deadline (a silent port's time). The
    cause is the engine's log's alone. The wait holds no slot and no budget (issue 42)."""
    timeout_s = 0.5
    a = await start_engine(tiny_model_ctx, **ENGINE)
    b = await start_engine(tiny_model_ctx, **ENGINE, kv_pull_timeout_s=timeout_s, kv_pull_uniform_timing=True)
    _, silent = await _silent_peer(nursery)
    talking = await _talking_peer(nursery)
    held: list[tuple[int, bool, int]] = []
    async with http(a) as ca, http(b) as cb:
        params = (await export(ca))["kv_transfer_params"]
        for port in (1, silent, talking):  # closed (refused at once), silent, talking
            t0 = trio.current_time()
            async with trio.open_nursery() as watch:
                watch.start_soon(_watch_holdings, b, held, port)
                _, body = await decode(cb, {**params, "remote_port": port})
                watch.cancel_scope.cancel()
            elapsed = trio.current_time() - t0
            kv = body["kv_transfer"]
            assert kv["status"] == "fallback" and kv["reason"] == "pull_failed", (port, kv)
            assert elapsed >= timeout_s, (port, elapsed)  # a lower bound: never early
        after = await scrape(cb)
    assert after[("hydra_kv_pulls_total", (("outcome", "fallback"), ("reason", "pull_failed")))] == 3
    assert not any(k[0] == "hydra_kv_pulls_total" and ("reason", "unreachable") in k[1] for k in after)
    # Sampled through each wait (its first half: the local prefill comes at its end): no
    # slot claimed, no payload budget held.
    for port in (1, silent, talking):
        samples = [(busy, used) for p, busy, used in held if p == port]
        assert samples and all(not busy and used == 0 for busy, used in samples[: len(samples) // 2]), (port, samples)


async def _watch_holdings(ep: Any, out: list[tuple[int, bool, int]], port: int) -> None:
    """(port, any slot busy, payload budget used) every few ms, until cancelled."""
    while True:
        slots = ep.state.engine._core.slots.slots
        out.append((port, any(s.busy for s in slots), ep.state.payload_budget.used))
        await trio.sleep(0.01)


class ResettingPeer:
    """An allowed peer that takes the connection and resets it at once (a prefill engine
    killed mid-exchange, a port behind a rejecting firewall)."""

    async def handle(self, stream: trio.SocketStream) -> None:
        sock = stream.socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.receive_some(65536)
        sock.close()


async def test_a_dead_or_resetting_peer_falls_back_at_once(
    start_engine: Callable[..., Any], tiny_model_ctx: Path, nursery: trio.Nursery
) -> None:
    """Issue 42: a pull refused (closed port) or reset by an allowed peer falls back to the
    local prefill at once, not at --kv-pull-timeout-s (60 s here: the whole test is far
    shorter), with the same text, and nothing left held."""
    a = await start_engine(tiny_model_ctx, **ENGINE)
    b = await start_engine(tiny_model_ctx, **ENGINE, kv_pull_timeout_s=60.0)
    listeners = await nursery.start(partial(trio.serve_tcp, ResettingPeer().handle, 0, host="127.0.0.1"))
    resetting = listeners[0].socket.getsockname()[1]
    async with http(a) as ca, http(b) as cb:
        await plain(cb)
        reference = await plain(cb)
        params = (await export(ca))["kv_transfer_params"]
        with trio.fail_after(30):  # a wait for the deadline would take 60 s per hand-off
            for port in (1, resetting, 1, resetting):
                text, body = await decode(cb, {**params, "remote_port": port})
                assert text == reference
                kv = body["kv_transfer"]
                assert kv["status"] == "fallback" and kv["reason"] == "pull_failed", (port, kv)
    assert b.state.payload_budget.used == 0
    await assert_server_healthy(b)


async def test_client_leaving_during_the_pull_cancels_it(pair: tuple[Any, Any], nursery: trio.Nursery) -> None:
    """The pull runs before the request claims a slot (a wedged prefill engine holds none),
    and a client that leaves while it runs cancels it."""
    a, b = pair
    peer, port = await _silent_peer(nursery)
    async with http(a) as ca:
        params = (await export(ca))["kv_transfer_params"]
    params["remote_port"] = port
    req = {"messages": PROMPT, "max_tokens": N, "temperature": 0, "stream": True, "kv_transfer_params": params}
    async with http(b) as cb, trio.open_nursery() as client:

        async def request() -> None:
            async with cb.stream("POST", "/v1/chat/completions", json=req) as r:
                await r.aread()

        client.start_soon(request)
        with trio.fail_after(10):
            await peer.connected.wait()  # the pull is under way
        assert not any(s.busy for s in b.state.engine._core.slots.slots)
        assert b.state.payload_budget.used == 0  # nothing announced, nothing charged
        client.cancel_scope.cancel()  # the client goes away
    with trio.fail_after(10):
        await peer.hung_up.wait()  # the pull's connection closed with it
    await assert_server_healthy(b)


async def test_params_that_ask_nothing_are_ignored(pair: tuple[Any, Any]) -> None:
    a, _ = pair
    async with http(a) as ca:
        reference = await plain(ca)
        nothing = {**PREFILL_PARAMS, "do_remote_decode": False}
        text, body = await decode(ca, nothing)
        # A prefill request that asks to stream still gets the JSON reply a router reads.
        r = await ca.post(
            "/v1/chat/completions",
            json={"messages": PROMPT, "max_tokens": 1, "stream": True, "kv_transfer_params": PREFILL_PARAMS},
        )
    assert text == reference and "kv_transfer" not in body and "kv_transfer_params" not in body
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["kv_transfer_params"]["hydra"]["export_id"]


async def test_export_keeps_the_identity_of_the_model_that_made_it(
    pair: tuple[Any, Any], tiny_model: Path
) -> None:
    """A staged model reload (CONFIGURE T3) between export and pull does not relabel the
    KV: the pull reports the model that computed it, so a decode engine serving that model
    still restores it (and one serving the new model would refuse it)."""
    a, b = pair
    async with http(a) as ca, http(b) as cb:
        reference = await plain(cb)
        params = (await export(ca))["kv_transfer_params"]
        async with await rpc(a) as c:
            assert (await c.configure(None, {"model_path": str(tiny_model)})).meta["tier"] == "T3"
        await wait_until(lambda: a.state.engine._core.t3_reloads == 1, 30.0)
        assert a.state.engine.identity.model_name != b.state.engine.identity.model_name
        text, body = await decode(cb, params)
    assert body["kv_transfer"]["status"] == "restored", body["kv_transfer"]
    assert text == reference


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_text_completions_hand_off_too(pair: tuple[Any, Any], stream: bool) -> None:
    """/v1/completions takes the same kv_transfer_params path as chat (vllm-router routes
    both): the decode engine restores the prompt and continues it, same text as one engine."""
    a, b = pair
    prompt = "the slot cache engine moves its keys " * 12
    req = {"prompt": prompt, "max_tokens": N, "temperature": 0}
    async with http(a) as ca, http(b) as cb:
        reference = (await ca.post("/v1/completions", json=req)).json()["choices"][0]["text"]
        r = await ca.post("/v1/completions", json={**req, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS})
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        before = await scrape(cb)
        body = {**req, "kv_transfer_params": params}
        if not stream:
            final = (await cb.post("/v1/completions", json=body)).json()
            text = final["choices"][0]["text"]
        else:
            async with cb.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                lines = [line async for line in resp.aiter_lines()]
            events, done = parse_sse(lines)
            assert done
            text = "".join(e["choices"][0]["text"] for e in events)
            final = events[-1]
        after = await scrape(cb)
    assert text == reference
    assert final["kv_transfer"]["status"] == "restored", final["kv_transfer"]
    assert final["usage"]["prompt_tokens_details"]["cached_tokens"] == params["hydra"]["n_past"]
    assert prompt_computed(after) - prompt_computed(before) == 0


async def test_a_pull_outside_kv_pull_allow_opens_no_connection(
    start_engine: Callable[..., Any], tiny_model_ctx: Path
) -> None:
    """kv_transfer_params name the address to pull from, and any HTTP client can write them:
    an address outside --kv-pull-allow gets no connection (a listener there sees nothing)
    and the request prefills locally, reason ``not_allowed``."""
    a = await start_engine(tiny_model_ctx, **ENGINE)
    b = await start_engine(tiny_model_ctx, **ENGINE, kv_pull_allow="192.0.2.0/24")
    accepted = []
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]

    async def count(stream: trio.SocketStream) -> None:
        accepted.append(stream)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(trio.serve_listeners, count, [listener]))
        async with http(a) as ca, http(b) as cb:
            params = (await export(ca))["kv_transfer_params"]
            for target in ({}, {"remote_port": port}):  # the real exporter, and the listener
                _, body = await decode(cb, {**params, **target})
                kv = body["kv_transfer"]
                assert kv == {**kv, "status": "fallback", "reason": "not_allowed"}, kv
                assert "detail" not in kv
            after = await scrape(cb)
        nursery.cancel_scope.cancel()
    assert accepted == []
    assert after[("hydra_kv_pulls_total", (("outcome", "fallback"), ("reason", "not_allowed")))] == 2
    assert len(a.state.exports) == 1  # never pulled: left to its lease


async def test_a_huge_claim_is_refused_at_once_while_budget_is_held(pair: tuple[Any, Any]) -> None:
    """Issue 28, 1.3: a ``kv_bytes`` claim over --max-kv-bytes (2^62, any client can write
    it) is refused before the payload budget is asked, also while something else holds
    budget: it never heads the FIFO queue, and a state upload beside it proceeds."""
    a, b = pair
    budget = b.state.payload_budget
    await budget.acquire(1000)  # load: another request's payload
    try:
        async with http(a) as ca, http(b) as cb:
            params = (await export(ca))["kv_transfer_params"]
            params["hydra"]["kv_bytes"] = 1 << 62
            await plain(cb)
            blob = (await cb.get("/slots/0/state")).content
            results: dict[str, Any] = {}

            async def handoff() -> None:
                results["decode"] = await decode(cb, params)

            async def upload() -> None:
                # Behind a queued claim it would wait (for the claim's whole deadline).
                await wait_until(lambda: "decode" in results or bool(budget.waiting))
                headers = {"content-type": "application/octet-stream", "content-length": str(len(blob))}
                results["put"] = await cb.put("/slots/0/state", content=blob, headers=headers)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(handoff)
                nursery.start_soon(upload)
        kv = results["decode"][1]["kv_transfer"]
        assert kv["status"] == "fallback" and kv["reason"] == "too_large", kv
        assert results["put"].status_code == 200, results["put"].text
        assert budget.used == 1000 and not budget.waiting
    finally:
        budget.release(1000)
    assert len(a.state.exports) == 1  # no connection was opened for it


BAD_FIELDS: list[tuple[str, Any]] = [
    ("remote_host", "a..b"),
    ("remote_host", "a" * 64),
    ("remote_host", "."),
    ("remote_host", "a\nb"),
    ("remote_host", "\u00e9\u00e9.example"),
    ("remote_host", "x" * 300),
    ("remote_host", ["127.0.0.1"]),
    ("remote_port", -1),
    ("remote_port", 1 << 70),
    ("remote_port", "8080"),
    ("remote_port", True),
    ("hydra.shm", {"probe": "/dev/shm/hydra-kv-0-1-0badcafe-probe\u0000", "token": "x"}),
    ("hydra.shm", {"probe": 5, "token": "x"}),
    ("hydra.shm", "yes"),
    ("hydra.kv_bytes", -5),
    ("hydra.kv_bytes", 1.5),
    ("hydra.n_past", None),
    ("hydra.export_id", "../../etc/passwd"),
    ("hydra.kv_hash", 7),
    ("hydra.kv_cache", []),
    ("hydra", []),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS, ids=[f"{f}={v!r}"[:40] for f, v in BAD_FIELDS])
async def test_malformed_kv_transfer_params_fall_back_as_bad_params(
    pair: tuple[Any, Any], field: str, value: Any
) -> None:
    """Issue 28, 1.7: each was (or could be) a 500 (UnicodeError from the resolver, a NUL in
    a path): a malformed field is ``bad_params``, before anything is resolved or opened."""
    a, b = pair
    async with http(a) as ca, http(b) as cb:
        params = (await export(ca))["kv_transfer_params"]
        params["hydra"].setdefault("shm", {"probe": "/dev/shm/x", "token": "x"})
        where, _, key = field.rpartition(".")
        (params["hydra"] if where else params)[key] = value
        _, body = await decode(cb, params)
    kv = body["kv_transfer"]
    assert kv["status"] == "fallback" and kv["reason"] == "bad_params", kv


async def test_the_cache_salt_travels_with_the_handoff(pair: tuple[Any, Any]) -> None:
    """The prefill engine computes under the request's cache_salt; the decode engine keeps
    the pulled KV as that salt's: the next request under the same salt continues it, one
    under another salt (or none) reuses nothing of it, on either engine."""
    a, b = pair
    salted = {"cache_salt": "tenant-a"}
    async with http(a) as ca, http(b) as cb:
        body = await export(ca, **salted)
        params = body["kv_transfer_params"]
        n = params["hydra"]["n_past"]
        _, final = await chat_text(
            cb, stream=False, messages=PROMPT, max_tokens=N, temperature=0, kv_transfer_params=params, **salted
        )
        assert final["kv_transfer"]["status"] == "restored"
        for c in (ca, cb):  # each engine's slot holds the prompt under "tenant-a"
            for salt, reused in (("tenant-b", False), (None, False), ("tenant-a", True)):
                extra = {} if salt is None else {"cache_salt": salt}
                _, again = await chat_text(c, stream=False, messages=PROMPT, max_tokens=2, temperature=0, **extra)
                cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert (cached >= n - 1) if reused else cached == 0, (c.base_url, salt, cached)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_pulled_export_s_budget_goes_back_when_no_slot_comes(
    start_engine: Callable[..., Any], tiny_model_ctx: Path, stream: bool
) -> None:
    """The pull runs before the claim: when the claim is then refused (every slot busy past
    --slot-wait-s), the pulled bytes' payload budget goes back with the request."""
    a = await start_engine(tiny_model_ctx, **ENGINE)
    b = await start_engine(tiny_model_ctx, **ENGINE, slot_wait_s=0.2)
    core = b.state.engine._core
    async with http(a) as ca, http(b) as cb:
        params = (await export(ca))["kv_transfer_params"]
        assert len(a.state.exports) == 1
        held = [core.slots.claim(s.id, "test:holder") for s in list(core.slots.slots)]
        try:
            req = {
                "messages": PROMPT,
                "max_tokens": N,
                "temperature": 0,
                "stream": stream,
                "kv_transfer_params": params,
            }
            r = await cb.post("/v1/chat/completions", json=req)
            assert r.status_code == 503, r.text
            assert len(a.state.exports) == 0  # it was pulled, before the claim was refused
        finally:
            for slot in held:
                core.slots.release(slot)
        await wait_until(lambda: b.state.payload_budget.used == 0, 10.0)
    await assert_server_healthy(b)
