"""GET / DELETE /v1/decode/{id} (spec §6.1, §6.2): SSE replay and live chunks for any number
of readers, plain GET while generating (404 + Retry-After) and with ?wait, failed requests,
bad and unknown ids, deleting a finished result."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import trio
import trio.testing

from helpers import (
    HYDRA_METRICS_KEYS,
    LONG_TURN,
    MESSAGES,
    SSE_HEADERS,
    Collected,
    chat_completion,
    decode_ok,
    entry_of,
    frame,
    gate,
    get_result,
    http,
    parse_sse,
    read_sse,
    rpc,
    sse_data,
    sse_text,
    text_of,
    wait_until,
)

N = 48


async def test_plain_get_while_generating_then_wait(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c, trio.open_nursery() as nursery:
        chat = await chat_completion(h, MESSAGES, N)
        async with gate(ep) as g:
            rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=N))
            # Tokenize; the slot's answer to the chat goes to the prompt cache before the
            # DECODE drops it; the cut to the reuse plan; prefill; one step: generating, with text.
            await g.step(5)
            entry = entry_of(ep, rid)
            assert entry.state.value == "generating" and entry.chunks
            r = await h.get(f"/v1/decode/{rid}")
            assert r.status_code == 404, r.text
            assert r.headers["Retry-After"] == "1"
            body = r.json()
            assert body["state"] == "generating"
            assert body["error"]["code"] == 404 and body["error"]["type"] == "not_ready"
            assert body["error"]["message"] == "decode_request_id not ready"
            # A bounded wait that runs out while the request is held still answers 404.
            r = await h.get(f"/v1/decode/{rid}", params={"wait": "0.05"})
            assert r.status_code == 404 and r.json()["state"] == "generating"
            # A long wait, registered before generation resumes, returns the result.
            waited: dict[str, Any] = {}

            async def wait_for_it() -> None:
                resp = await h.get(f"/v1/decode/{rid}", params={"wait": "60"})
                waited["status"], waited["body"] = resp.status_code, resp.json()

            nursery.start_soon(wait_for_it)
            # The waiting GET has subscribed once every task of this process is blocked
            # (the worker is held by the gate, so generation cannot move).
            await trio.testing.wait_all_tasks_blocked()
            assert entry.reader_count == 1
        # The nursery has waited for wait_for_it: the GET has its answer.
    assert waited["status"] == 200, waited
    body = waited["body"]
    assert body["object"] == "chat.completion"
    assert text_of(body) == text_of(chat)
    assert body["usage"]["completion_tokens"] > 0
    assert HYDRA_METRICS_KEYS <= body["hydra_metrics"].keys()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["id_slot"] == 0 and isinstance(body["created"], int) and body["model"]


async def test_sse_readers_early_late_concurrent_and_leaving(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c:
        chat = await chat_completion(h, MESSAGES, N)
        early, late, late2, leaver = Collected(), Collected(), Collected(), Collected()
        async with trio.open_nursery() as readers:
            async with gate(ep) as g:
                rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=N))
                entry = entry_of(ep, rid)
                readers.start_soon(read_sse, h, rid, early)
                await trio.testing.wait_all_tasks_blocked()  # the worker is held: all wait
                assert early.lines  # the role chunk arrived
                await g.step(2)  # tokenize, prefill
                await g.step(10)  # ten tokens
                n_before_join = len(entry.chunks)
                assert n_before_join >= 3 and entry.running
                # Late readers join now: they must get the chunks they missed.
                readers.start_soon(read_sse, h, rid, late)
                readers.start_soon(read_sse, h, rid, late2)
                async with trio.open_nursery() as one:
                    one.start_soon(partial(read_sse, h, rid, leaver, stop_after=3))
                # The leaver disconnected while generation is paused; resume it.
                await wait_until(
                    lambda: (
                        sum(1 for x in late.lines or [] if sse_data(x) is not None) > n_before_join
                    )
                )
        final = await get_result(h, rid)
        after = Collected()
        await read_sse(h, rid, after)  # a reader of the finished request: full replay
    assert early.status == late.status == late2.status == leaver.status == after.status == 200
    # Every reader saw the very same stream (same chunks, same final chunk).
    assert early.lines == late.lines == late2.lines == after.lines
    events, done = parse_sse(early.lines or [])
    assert done, "stream must end with data: [DONE]"
    assert [x for x in early.lines or [] if x][-1] == "data: [DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(
        e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events
    )
    assert sse_text(events) == text_of(final)
    last = events[-1]
    assert last["choices"][0]["delta"] == {}
    assert last["choices"][0]["finish_reason"] == final["choices"][0]["finish_reason"]
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    assert last["usage"] == final["usage"]
    assert last["id_slot"] == 0
    assert HYDRA_METRICS_KEYS <= last["hydra_metrics"].keys()
    assert last["hydra_metrics"]["decode_request_id"] == rid
    assert last["hydra_metrics"]["tokens_per_s"] > 0
    # The reader that left did not stop generation: the full answer was generated.
    leaver_events, leaver_done = parse_sse(leaver.lines or [])
    assert len(leaver_events) == 3 and not leaver_done
    assert text_of(final) == text_of(chat)
    assert final["usage"]["completion_tokens"] == chat["usage"]["completion_tokens"]


async def test_failed_request_is_400_decode_failed(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """A prompt longer than the context is refused after the ack (tokenizing runs in the
    request task): the request fails; its id reads 400 DECODE_FAILED, plain and SSE."""
    ep = await start_engine(tiny_model, ctx_size=1024)
    async with http(ep) as h, await rpc(ep) as c:
        rid = await decode_ok(c, 0, frame([*MESSAGES, LONG_TURN], n_predict=N))
        r = await h.get(f"/v1/decode/{rid}", params={"wait": "30"})
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["error_code"] == "DECODE_FAILED"
        assert body["error"]["code"] == 400 and body["error"]["message"]
        assert body.get("reason_code") == "TOO_LARGE"
        r = await h.get(f"/v1/decode/{rid}", headers=SSE_HEADERS)
        assert r.status_code == 400 and r.json()["error_code"] == "DECODE_FAILED"
        listed = [e for e in (await h.get("/v1/decode")).json() if e["decode_request_id"] == rid]
        assert listed == [{"decode_request_id": rid, "state": "failed", "id_slot": 0}]
        meta = (await c.state_meta(0)).meta
        assert meta["is_processing"] is False
        # A finished (failed) entry is deleted, not cancelled.
        d = await h.delete(f"/v1/decode/{rid}")
        assert d.status_code == 200
        assert d.json() == {"cancelled": False, "decode_request_id": rid, "state": "deleted"}
        r = await h.get(f"/v1/decode/{rid}")
        assert r.status_code == 410 and r.json()["state"] == "deleted"


async def test_delete_of_a_finished_result(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c:
        rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=8))
        await get_result(h, rid)
        again = await get_result(h, rid)  # results stay readable
        assert again["hydra_metrics"]["decode_request_id"] == rid
        d = await h.delete(f"/v1/decode/{rid}")
        assert d.status_code == 200
        assert d.json() == {"cancelled": False, "decode_request_id": rid, "state": "deleted"}
        for headers in ({}, SSE_HEADERS):
            r = await h.get(f"/v1/decode/{rid}", headers=headers)
            assert r.status_code == 410 and r.json()["state"] == "deleted"
        d = await h.delete(f"/v1/decode/{rid}")
        assert d.status_code == 410 and d.json()["state"] == "deleted"


async def test_bad_and_unknown_ids(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c:
        rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=4))
        await get_result(h, rid)
        unknown = 1 if rid != 1 else 2
        for headers in ({}, SSE_HEADERS):
            for bad in ("abc", "1.5", "0x10", "%20"):
                r = await h.get(f"/v1/decode/{bad}", headers=headers)
                assert r.status_code == 400, (bad, r.text)
                assert r.json()["error"]["code"] == 400
            r = await h.get(f"/v1/decode/{unknown}", headers=headers)
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == 404
        for bad in ("abc", "1.5"):
            assert (await h.delete(f"/v1/decode/{bad}")).status_code == 400
        gone = await h.delete(f"/v1/decode/{unknown}")
        # The same OpenAI-shaped error object as GET's 404.
        assert gone.status_code == 404 and gone.json()["error"] == {
            "code": 404, "message": "no such decode request", "type": "not_found_error", "param": None
        } and gone.json()["decode_request_id"] == unknown
        assert (await h.get(f"/v1/decode/{rid}")).status_code == 200  # untouched by all that
