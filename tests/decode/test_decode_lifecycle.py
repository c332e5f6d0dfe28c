"""The decode request lifecycle (spec §4.3, §6.2): validation timeout, DELETE during restore /
delta prefill / token loop, the RPC connection closing before the reply.

Determinism: the test holds the GPU worker (helpers.WorkerGate) so a request sits
exactly where the test wants it (restore queued, prefill chunk queued, step queued), and
"later" is "after an identical request ran to its end", never a bare sleep.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from helpers import (
    LONG_TURN,
    MESSAGES,
    OTHER_MESSAGES,
    chat_completion,
    decode,
    decode_ok,
    entry_of,
    frame,
    gate,
    get_result,
    http,
    kv_meta,
    prefill,
    reset_on_close,
    rpc,
    slot_meta,
    slot_tokens,
    store,
    text_of,
    tombstone_state,
    wait_listed,
    wait_until,
)
from hydra_trio.rpc.client import RpcClient, RpcResponse, decode_call
from hydra_trio.wire import Op, Status, encode_request

N = 12
LONG_N = 1500  # far more than any of these tests lets run
STOPPED_N = 64  # for a request held by the gate: more than it can generate before the DELETE



class Background:
    """Run one coroutine in a nursery and keep its result."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: Any = None

    def start(self, nursery: trio.Nursery, fn: Callable[..., Any], *args: Any) -> Background:
        async def runner() -> None:
            try:
                self.value = await fn(*args)
            finally:
                self.done.set()

        nursery.start_soon(runner)
        return self

    async def result(self, timeout_s: float = 30.0) -> Any:
        with trio.fail_after(timeout_s):
            await self.done.wait()
        return self.value


def assert_cancelled_reply(body: dict[str, Any], rid: int) -> None:
    """DELETE of a running request (spec §6.2); extra keys ("ours") are allowed."""
    expected = {"cancelled": True, "decode_request_id": rid, "state": "cancelled"}
    assert {k: body.get(k) for k in expected} == expected, body


# ---- validation timeout ---------------------------------------------------------------------


@dataclass
class Stopped:
    """A request that was stopped before its reply, and what the test saw."""

    ep: Any
    h: Any
    c: Any
    rid: int
    resp: RpcResponse | None
    before: list[int]  # slot 0 tokens before the DECODE
    calls_before_release: int  # GPU-worker calls made when the worker was given back


@asynccontextmanager
async def timed_out(start_engine: Callable[..., Any], tiny_model: Path) -> AsyncIterator[Stopped]:
    ep = await start_engine(tiny_model, decode_validate_timeout_s=0.3)
    async with http(ep) as h, await rpc(ep) as c:
        pre = await prefill(c, 1, MESSAGES)
        await prefill(c, 0, OTHER_MESSAGES)
        before = await slot_tokens(c, 0)
        async with gate(ep) as g:
            # We hold the worker from before the DECODE: its restore can only queue, and the
            # deadline expires while the worker is still busy.
            with trio.fail_after(10):
                resp = await decode(
                    c, 0, frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=kv_meta(pre))
                )
            assert resp.status != Status.OK, resp.meta
            rid = resp.meta["decode_request_id"]
            assert g.waiting == 0  # the queued restore was withdrawn
            assert tombstone_state(ep, rid) == "timed_out"
            meta = await slot_meta(c, 0)
            assert meta["is_processing"] is False and meta["n_past"] == len(before)
            calls = ep.state.engine._core.worker.calls
        yield Stopped(ep, h, c, rid, resp, before, calls)


async def test_validation_timeout_leaves_the_slot_as_it_was(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    async with timed_out(start_engine, tiny_model) as s:
        assert s.resp is not None and s.resp.status != Status.OK
        r = await s.h.get(f"/v1/decode/{s.rid}")
        assert r.status_code == 410 and r.json()["state"] == "timed_out"
        # After the busy work ended: the slot is unchanged and nothing ran for the request.
        assert await slot_tokens(s.c, 0) == s.before
        assert s.ep.state.engine._core.worker.calls == s.calls_before_release + 1  # the STATE_GET
        r = await s.h.get(f"/v1/decode/{s.rid}")
        assert r.status_code == 410 and r.json()["state"] == "timed_out"
        d = await s.h.delete(f"/v1/decode/{s.rid}")
        assert d.status_code == 410
        assert (await slot_meta(s.c, 0))["n_past"] == len(s.before)
        # And the slot is usable.
        rid = await decode_ok(s.c, 0, frame(MESSAGES, n_predict=N))
        assert text_of(await get_result(s.h, rid)) == text_of(
            await chat_completion(s.h, MESSAGES, N)
        )


async def test_validation_timeout_reply(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    async with timed_out(start_engine, tiny_model) as s:
        assert s.resp is not None
        assert (Status(s.resp.status).name, s.resp.meta.get("error_code")) == (
            "ERROR",
            "TIMEOUT",
        ), s.resp.meta
        assert s.resp.meta["error"] == "validation timeout"
        assert s.resp.meta["decode_request_id"] == s.rid


# ---- DELETE while the restore waits for the worker ---------------------------------------------


@asynccontextmanager
async def deleted_while_restoring(
    start_engine: Callable[..., Any], tiny_model: Path
) -> AsyncIterator[Stopped]:
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c, await rpc(ep) as c2:
        pre = await prefill(c, 1, MESSAGES)
        await prefill(c, 0, OTHER_MESSAGES)
        before = await slot_tokens(c, 0)
        async with trio.open_nursery() as nursery, gate(ep) as g:
            reply = Background().start(
                nursery,
                decode,
                c2,
                0,
                frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=kv_meta(pre)),
            )
            rid = (await wait_listed(h, "restoring"))["decode_request_id"]
            await g.wait_queued(1)
            # DELETE returns while we still hold the worker: the queued restore never runs.
            d = await h.delete(f"/v1/decode/{rid}")
            assert d.status_code == 200, d.text
            assert_cancelled_reply(d.json(), rid)
            resp = await reply.result(timeout_s=10)
            meta = await slot_meta(c, 0)
            assert meta["is_processing"] is False and meta["n_past"] == len(before)
            r = await h.get(f"/v1/decode/{rid}")
            assert r.status_code == 410 and r.json()["state"] == "cancelled"
            calls = ep.state.engine._core.worker.calls
        yield Stopped(ep, h, c, rid, resp, before, calls)


async def test_delete_during_restore(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    async with deleted_while_restoring(start_engine, tiny_model) as s:
        assert s.resp is not None and s.resp.status != Status.OK
        assert await slot_tokens(s.c, 0) == s.before
        assert s.ep.state.engine._core.worker.calls == s.calls_before_release + 1  # the STATE_GET
        r = await s.h.get(f"/v1/decode/{s.rid}")
        assert r.status_code == 410 and r.json()["state"] == "cancelled"
        d = await s.h.delete(f"/v1/decode/{s.rid}")
        assert d.status_code == 410 and d.json()["state"] == "cancelled"
        rid = await decode_ok(s.c, 0, frame(MESSAGES, n_predict=N))
        assert text_of(await get_result(s.h, rid)) == text_of(
            await chat_completion(s.h, MESSAGES, N)
        )


async def test_delete_during_restore_reply(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    async with deleted_while_restoring(start_engine, tiny_model) as s:
        assert s.resp is not None and s.resp.status != Status.OK
        assert s.resp.meta.get("state") == "cancelled", s.resp.meta
        assert s.resp.meta.get("decode_request_id") == s.rid
        assert s.resp.meta.get("error_code") not in (None, "", "INTERNAL")


# ---- DELETE during the delta prefill ------------------------------------------------------------


async def test_delete_during_delta_prefill(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """The DECODE prompt extends the KV by ~1400 tokens, prefilled in 64-token chunks; DELETE
    lands while chunk 4 waits for the worker."""
    ep = await start_engine(tiny_model, batch_size=64)
    engine = ep.state.engine
    long_prompt = [*MESSAGES, LONG_TURN]
    async with http(ep) as h, await rpc(ep) as c:
        pre = await prefill(c, 0, MESSAGES, add_generation_prompt=False)
        n_kv = pre.meta["n_past"]
        async with trio.open_nursery() as nursery, gate(ep) as g:
            reply = Background().start(
                nursery,
                decode,
                c,
                1,
                frame(long_prompt, pre.payload, n_predict=LONG_N, kv_metadata=kv_meta(pre)),
            )
            await g.step(1)  # the restore
            resp = await reply.result()
            assert resp.status == Status.OK, resp.meta
            rid = resp.meta["decode_request_id"]
            entry = entry_of(ep, rid)
            await g.step(1)  # tokenize
            await g.step(3)  # three prefill chunks
            await g.wait_queued(1)  # the fourth chunk
            res = entry.result
            assert res is not None and res.first_token_at is None and res.completion_tokens == 0
            assert res.n_prompt_processed > 10 * 64  # a long delta really is being prefilled
            assert engine._core.n_past(1) == n_kv + 3 * 64
            processed = engine._core.prompt_tokens_processed
            d = await h.delete(f"/v1/decode/{rid}")
            assert d.status_code == 200, d.text
            assert_cancelled_reply(d.json(), rid)
            assert entry.state.value == "cancelled"
            meta = await slot_meta(c, 1)
            assert meta["is_processing"] is False
            n_past_after = meta["n_past"]
        # The worker is free again. Run the same request to its end on the other slot: the
        # cancelled one would have finished by then.
        other = await decode_ok(
            c, 0, frame(long_prompt, pre.payload, n_predict=N, kv_metadata=kv_meta(pre))
        )
        body = await get_result(h, other)
        assert (
            engine._core.prompt_tokens_processed
            == processed + body["hydra_metrics"]["n_prompt_processed"]
        )
        assert res.completion_tokens == 0 and res.first_token_at is None
        assert engine._core.n_past(1) == n_past_after
        r = await h.get(f"/v1/decode/{rid}")
        assert r.status_code == 410 and r.json()["state"] == "cancelled"
        assert (await slot_meta(c, 1))["is_processing"] is False



async def test_delete_aborts_a_running_prefill_chunk(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """One ~1400-token prefill chunk (batch_size 2048) is running in llama_decode when DELETE
    lands: the abort flag stops it, the request is cancelled and its partial chunk is gone."""
    ep = await start_engine(tiny_model, batch_size=2048)
    engine = ep.state.engine
    long_prompt = [*MESSAGES, LONG_TURN]
    async with http(ep) as h, await rpc(ep) as c:
        async with gate(ep) as g:
            rid = await decode_ok(c, 1, frame(long_prompt, n_predict=LONG_N))  # no KV: no restore
            entry = entry_of(ep, rid)
            await g.step(1)  # tokenize
            await g.wait_queued(1)  # the one prefill chunk
            processed = engine._core.prompt_tokens_processed
            g.open()

            # The prefill chunk is the only call left: once the worker thread runs a call,
            # it is that chunk's llama_decode (polled: a thread cannot wake a trio task).
            await wait_until(lambda: engine._core.worker.running)
            d = await h.delete(f"/v1/decode/{rid}")
        if engine._core.prompt_tokens_processed != processed:
            pytest.skip(
                "the prefill chunk finished before the DELETE landed (machine too slow/fast)"
            )
        assert d.status_code == 200, d.text
        assert_cancelled_reply(d.json(), rid)
        assert entry.result.completion_tokens == 0
        meta = await slot_meta(c, 1)
        assert meta["is_processing"] is False
        assert meta["n_past"] == 0  # the aborted chunk left no cells behind
        r = await h.get(f"/v1/decode/{rid}")
        assert r.status_code == 410 and r.json()["state"] == "cancelled"


# ---- DELETE during the token loop ---------------------------------------------------------------


async def test_delete_during_token_loop(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model)
    engine = ep.state.engine
    async with http(ep) as h, await rpc(ep) as c:
        async with trio.open_nursery() as nursery, gate(ep) as g:
            # Paused by the gate, it cannot run far: 64 tokens is plenty ("long-running").
            rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=STOPPED_N))
            entry = entry_of(ep, rid)
            await g.step(2)  # tokenize, prefill (samples the first token)
            await g.step(5)  # five generation steps
            await g.wait_queued(1)  # the next step, batched, waits for the worker
            res = entry.result
            assert entry.state.value == "generating" and 5 <= res.completion_tokens < STOPPED_N
            deleted = Background().start(nursery, h.delete, f"/v1/decode/{rid}")
            await trio.testing.wait_all_tasks_blocked()  # the DELETE reached the manager
            assert entry.task.scope.cancel_called
            # The step in flight must finish before the task can stop: no reply yet.
            assert not deleted.done.is_set()
            g.open()
            d = await deleted.result()
            # Everything below is "after the DELETE reply".
            count = res.completion_tokens
            generated = engine._core.tokens_generated
            n_past = engine._core.n_past(0)
            assert d.status_code == 200, d.text
            assert_cancelled_reply(d.json(), rid)
            assert entry.state.value == "cancelled"
            meta = await slot_meta(c, 0)
            assert meta["is_processing"] is False and meta["n_past"] == n_past
            r = await h.get(f"/v1/decode/{rid}")
            assert r.status_code == 410 and r.json()["state"] == "cancelled"
        # The same request, to its end, on the other slot: by then the cancelled one would
        # have finished too.
        other = await decode_ok(c, 1, frame(MESSAGES, n_predict=STOPPED_N))
        body = await get_result(h, other)
        assert body["usage"]["completion_tokens"] > count
        assert res.completion_tokens == count
        assert engine._core.tokens_generated == generated + body["usage"]["completion_tokens"]
        assert engine._core.n_past(0) == n_past
        r = await h.get(f"/v1/decode/{rid}")
        assert r.status_code == 410 and r.json()["state"] == "cancelled"
        assert store(ep).get(rid).state.value == "cancelled"
        # The text generated before the DELETE was the start of the full answer.
        assert text_of(body).startswith(res.text)


# ---- the RPC connection closes before the reply -------------------------------------------------


async def _raw_stream(ep: Any) -> trio.SocketStream:
    """A plain client connection (the test decides how it closes)."""
    return await trio.open_tcp_stream("127.0.0.1", ep.rpc_port)



async def test_connection_reset_before_reply_cancels_the_request_at_once(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """A peer that resets is gone for sure: its queued restore is withdrawn, no GPU call runs
    for the request and the slot keeps what it held."""
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c:
        pre = await prefill(c, 1, MESSAGES)
        await prefill(c, 0, OTHER_MESSAGES)
        before = await slot_tokens(c, 0)
        async with gate(ep) as g:
            raw = await _raw_stream(ep)
            payload = frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=kv_meta(pre))
            await raw.send_all(encode_request(Op.DECODE, b"0", payload))
            rid = (await wait_listed(h, "restoring"))["decode_request_id"]
            await g.wait_queued(1)
            entry = entry_of(ep, rid)
            reset_on_close(raw)
            await raw.aclose()  # nobody will ever learn the id
            with trio.fail_after(10):
                await entry.ended.wait()
            assert tombstone_state(ep, rid) == "cancelled"
            meta = await slot_meta(c, 0)
            assert meta["is_processing"] is False and meta["n_past"] == len(before)
            calls = ep.state.engine._core.worker.calls
        assert await slot_tokens(c, 0) == before
        assert ep.state.engine._core.worker.calls == calls + 1  # the STATE_GET; nothing for the request
        r = await h.get(f"/v1/decode/{rid}")
        assert r.status_code == 410 and r.json()["state"] == "cancelled"
        rid2 = await decode_ok(
            c, 0, frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=kv_meta(pre))
        )
        assert text_of(await get_result(h, rid2)) == text_of(await chat_completion(h, MESSAGES, N))


async def test_connection_closed_before_reply_cancels_the_request(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """A peer that closed (FIN) before the reply looks like one that half-closed until the
    reply reaches it: the restore runs and the reply is written; the closed socket answers it
    with a reset, and the request is cancelled (nobody read its id) and its slot freed."""
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c:
        pre = await prefill(c, 1, MESSAGES)
        async with gate(ep) as g:
            raw = await _raw_stream(ep)
            payload = frame(MESSAGES, pre.payload, n_predict=LONG_N, kv_metadata=kv_meta(pre))
            await raw.send_all(encode_request(Op.DECODE, b"0", payload))
            rid = (await wait_listed(h, "restoring"))["decode_request_id"]
            await g.wait_queued(1)
            entry = entry_of(ep, rid)
            await raw.aclose()
        with trio.fail_after(30):
            await entry.ended.wait()
        assert tombstone_state(ep, rid) == "cancelled"
        assert entry.result is None or entry.result.completion_tokens < LONG_N
        assert (await slot_meta(c, 0))["is_processing"] is False
        r = await h.get(f"/v1/decode/{rid}")
        assert r.status_code == 410 and r.json()["state"] == "cancelled"


async def test_request_that_finished_before_its_reply_was_refused_is_cancelled(
    start_engine: Callable[..., Any], tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A closed peer's reset is seen only after the reply; a short request may be done by
    then. Nobody learned its id: it still ends as a cancelled tombstone, not a result."""
    from hydra_trio.rpc import peer

    ep = await start_engine(tiny_model)
    real = peer.reset_after_reply
    finished: list[str] = []

    async def after_the_request_ended(sock: Any) -> bool:
        entry = store(ep).entries()[0]
        await entry.ended.wait()
        finished.append(entry.state.value)
        return await real(sock)

    monkeypatch.setattr(peer, "reset_after_reply", after_the_request_ended)
    async with await rpc(ep) as c:
        pre = await prefill(c, 1, MESSAGES)
    raw = await _raw_stream(ep)
    async with gate(ep) as g:
        payload = frame(MESSAGES, pre.payload, n_predict=2, kv_metadata=kv_meta(pre))
        await raw.send_all(encode_request(Op.DECODE, b"0", payload))
        await g.wait_queued(1)
        rid = store(ep).entries()[0].id
        await raw.aclose()
    with trio.fail_after(30):
        await wait_until(lambda: tombstone_state(ep, rid) is not None)
    assert finished == ["done"]
    assert tombstone_state(ep, rid) == "cancelled"
    async with await rpc(ep) as c:
        assert (await slot_meta(c, 0))["is_processing"] is False


async def _read_after_half_close(stream: trio.SocketStream) -> RpcResponse:
    """The one reply to what was sent before our SHUT_WR; then the server closes."""
    client = RpcClient(stream)
    with trio.fail_after(30):
        resp = await client.read_response()
        assert await stream.receive_some(1) == b""  # it ends the connection after our EOF
    return resp


@pytest.mark.parametrize("close", ["fin", "reset"])
async def test_a_cancelled_prefill_stops_within_the_chunk_it_is_in(
    start_engine: Callable[..., Any], tiny_model: Path, close: str
) -> None:
    """A PREFILL whose client closes its socket, normally (a FIN: what the coordinator does
    when it cancels) or with a reset, stops within the chunk it is in: its next chunk, queued
    for the GPU worker, never runs, no reply is written, the slot is free. (A FIN looks like a
    half-close; a PREFILL takes it as the hang-up: rpc/peer.py.)"""
    ep = await start_engine(tiny_model)  # 64-token chunks: the long prompt takes ~22
    core = ep.state.engine._core
    request = json.dumps({"messages": [LONG_TURN]}).encode()

    def connections() -> float:
        return ep.state.metrics.registry.get_sample_value("hydra_rpc_connections") or 0.0

    async with gate(ep) as g:
        raw = await _raw_stream(ep)
        await raw.send_all(encode_request(Op.PREFILL, b"0", request))
        while core.prompt_tokens_processed < 2 * 64:  # mid-prompt: two chunks computed
            await g.step()
        await g.wait_queued(1)  # the next chunk waits for the worker
        done = core.prompt_tokens_processed
        if close == "reset":
            reset_on_close(raw)
        await raw.aclose()
        # Seen while the test still holds the worker: the queued chunk was withdrawn.
        await wait_until(lambda: g.waiting == 0 and connections() == 0)
        assert core.prompt_tokens_processed == done
        assert not core.slots.slots[0].busy
    async with await rpc(ep) as c:
        full = await c.prefill(0, {"messages": [LONG_TURN]})  # the slot serves the next one
    assert done < full.meta["n_past"] - 64


async def test_half_closed_client_gets_its_decode_reply_and_the_decode_completes(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c:
        pre = await prefill(c, 1, MESSAGES)
        async with gate(ep) as g:
            raw = await _raw_stream(ep)
            payload = frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=kv_meta(pre))
            await raw.send_all(encode_request(Op.DECODE, b"0", payload))
            await g.wait_queued(1)  # the restore waits for the worker
            await raw.send_eof()  # the EOF is there before the reply
            await trio.testing.wait_all_tasks_blocked()
        resp = await _read_after_half_close(raw)
        await raw.aclose()
        assert resp.status == Status.OK, resp.meta
        rid = resp.meta["decode_request_id"]
        body = await get_result(h, rid)
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == N
        assert text_of(body) == text_of(await chat_completion(h, MESSAGES, N))


async def test_close_in_the_batch_of_the_ack_cancels_the_request(
    start_engine: Callable[..., Any], tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peer's close and the end of the restore wake the RPC handler and the disconnect
    watcher in the same scheduler batch, in either order: the request is still cancelled
    (nobody received its id) and its slot is free. The close is made from inside the
    request's last synchronous step before the ack (reading ``n_past_after_restore``), so
    the EOF is in the kernel when the handler is woken with the ack."""
    ep = await start_engine(tiny_model)
    engine = ep.state.engine
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", ep.rpc_port))
    seen: list[Any] = []
    hung_up = trio.Event()
    real_n_past = engine._core.n_past

    def n_past_then_hang_up(slot: int) -> int:
        if not hung_up.is_set() and store(ep).running():
            seen.append(store(ep).running()[0])
            sock.close()  # synchronous: no checkpoint between this and the ack
            hung_up.set()
        return real_n_past(slot)

    monkeypatch.setattr(engine._core, "n_past", n_past_then_hang_up)
    await sock.send(encode_request(Op.DECODE, b"0", frame(MESSAGES, n_predict=LONG_N)))
    with trio.fail_after(30):
        await hung_up.wait()
        await seen[0].ended.wait()
    monkeypatch.undo()
    entry = seen[0]
    assert tombstone_state(ep, entry.id) == "cancelled"
    assert entry.result is None or entry.result.completion_tokens < LONG_N
    async with await rpc(ep) as c:
        assert (await slot_meta(c, 0))["is_processing"] is False


async def test_connection_closed_after_reply_does_not_cancel(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h:
        async with gate(ep):
            raw = await rpc(ep)
            resp = await raw.call(decode_call(0, frame(MESSAGES, n_predict=N)), check=False)
            assert resp.status == Status.OK, resp.meta
            rid = resp.meta["decode_request_id"]
            await raw.aclose()
        body = await get_result(h, rid)
        assert text_of(body) == text_of(await chat_completion(h, MESSAGES, N))
