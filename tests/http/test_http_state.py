"""HTTP slot-state transfer and the payload budget: an upload lives in one buffer taken from
the budget RPC payloads use (refused when too large or when no room comes in time), and a
download is streamed from the snapshot, never joined into a second copy."""

from __future__ import annotations

import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from helpers import ENGINE, MESSAGES, http, rpc, wait_until

OCTETS = {"content-type": "application/octet-stream"}


async def state_blob(ep: Any, slot: int = 0, request: dict[str, Any] | None = None) -> bytes:
    async with await rpc(ep) as c:
        await c.prefill(slot, request or {"messages": MESSAGES})
        return bytes((await c.state_get(slot)).payload)


async def test_an_upload_holds_its_size_of_the_payload_budget_while_in_flight(
    start_engine: Any, tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model, **ENGINE)
    blob = await state_blob(ep)
    budget = ep.state.payload_budget
    rest_may_go = trio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield blob[:100]
        await rest_may_go.wait()
        yield blob[100:]

    async with http(ep) as h:
        async with trio.open_nursery() as nursery:
            result: dict[str, Any] = {}

            async def upload() -> None:
                headers = {**OCTETS, "content-length": str(len(blob))}
                result["r"] = await h.put("/slots/1/state", content=body(), headers=headers)

            nursery.start_soon(upload)
            await wait_until(lambda: _true(budget.used == len(blob)))
            metrics = (await h.get("/metrics")).text
            assert f"hydra_payload_bytes_held {float(len(blob))}" in metrics
            rest_may_go.set()
        r = result["r"]
        assert r.status_code == 200, r.text
        assert budget.used == 0
        assert (await h.get("/slots/1/state/meta")).json()["n_past"] == r.json()["n_past"] > 0


async def test_an_upload_waits_for_room_then_gets_503(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, max_inflight_bytes=1000, idle_timeout_s=0.3, **ENGINE)
    blob = await state_blob(ep)
    budget = ep.state.payload_budget
    await budget.acquire(1000)  # RPC payloads hold the whole budget
    try:
        async with http(ep) as h:
            r = await h.put("/slots/1/state", content=blob, headers=OCTETS)
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "unavailable_error"
            assert budget.used == 1000
    finally:
        budget.release(1000)
    async with http(ep) as h:  # with room, the same upload goes through
        assert (await h.put("/slots/1/state", content=blob, headers=OCTETS)).status_code == 200
    assert budget.used == 0


async def test_an_upload_over_the_cap_or_without_a_length_is_refused(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, max_kv_bytes=1000, **ENGINE)

    async def chunked() -> AsyncIterator[bytes]:
        yield b"\x02" * 10

    async with http(ep) as h:
        r = await h.put("/slots/1/state", content=b"\x02" * 2000, headers=OCTETS)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == 413
        r = await h.put("/slots/1/state", content=chunked(), headers=OCTETS)  # chunked: no length
        assert r.status_code == 411, r.text
    assert ep.state.payload_budget.used == 0


@pytest.mark.parametrize("direction", ["get", "put"])
async def test_a_blob_crosses_http_held_once(start_engine: Any, wide_kv_model: Path, direction: str) -> None:
    """Peak Python memory during one transfer of a ~5 MB blob (the client reads/writes in
    chunks in this same process): about one blob, not the two or three copies that joining
    (GET) or get_data + bytearray (PUT) made."""
    ep = await start_engine(wide_kv_model, threads=1, slots=2)
    blob = await state_blob(ep, 0, {"prompt": "hello world " * 60})
    assert len(blob) > 4 << 20

    async def body() -> AsyncIterator[bytes]:
        for off in range(0, len(blob), 1 << 16):
            yield blob[off : off + (1 << 16)]

    async with http(ep) as h:
        tracemalloc.start()
        try:
            if direction == "get":
                got = 0
                async with h.stream("GET", "/slots/0/state") as r:
                    assert r.headers["content-length"] == str(len(blob))
                    async for chunk in r.aiter_bytes():
                        got += len(chunk)
                assert got == len(blob)
            else:
                headers = {**OCTETS, "content-length": str(len(blob))}
                r = await h.put("/slots/1/state", content=body(), headers=headers)
                assert r.status_code == 200, r.text
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 1.5 * len(blob), (peak, len(blob))


async def _true(value: bool) -> bool:
    return value


async def test_an_upload_waiting_for_room_is_not_buffered(start_engine: Any, wide_kv_model: Path) -> None:
    """While the upload waits for budget room its body stays in the socket: Quart would
    otherwise read all of it into its own buffer, outside the budget."""
    ep = await start_engine(wide_kv_model, threads=1, slots=2, idle_timeout_s=0.5)
    blob = await state_blob(ep, 0, {"prompt": "hello world " * 60})
    budget = ep.state.payload_budget
    await budget.acquire(ep.state.settings.max_inflight_bytes)

    async def body() -> AsyncIterator[bytes]:
        for off in range(0, len(blob), 1 << 16):
            yield blob[off : off + (1 << 16)]

    try:
        async with http(ep) as h:
            tracemalloc.start()
            try:
                headers = {**OCTETS, "content-length": str(len(blob))}
                r = await h.put("/slots/1/state", content=body(), headers=headers)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert r.status_code == 503, r.text
    finally:
        budget.release(ep.state.settings.max_inflight_bytes)
    assert peak < 0.5 * len(blob), (peak, len(blob))


async def test_a_snapshot_is_charged_to_the_payload_budget_until_it_is_sent(
    start_engine: Any, wide_kv_model: Path
) -> None:
    """A slow reader of GET /slots/{id}/state holds the snapshot: its bytes count in the
    payload budget until the last one is sent (or the reader leaves), so snapshots for slow
    readers cannot pile up outside --max-inflight-bytes."""
    ep = await start_engine(wide_kv_model, threads=1, slots=2)
    blob = await state_blob(ep, 0, {"prompt": "hello world " * 60})
    budget = ep.state.payload_budget
    async with http(ep) as h:
        async with h.stream("GET", "/slots/0/state") as r:
            first = await r.aiter_bytes().__anext__()
            assert first and budget.used >= len(blob)  # held while the reader dawdles
        await wait_until(lambda: budget.used == 0)  # the reader left: released
        got = (await h.get("/slots/0/state")).content
        assert len(got) == len(blob) and budget.used == 0


async def test_a_refused_upload_s_drain_has_one_deadline(autojump_clock: trio.abc.Clock) -> None:
    """Issue 28, 1.10: a sender dripping a byte just inside the idle timeout kept the drain
    of a refused state PUT (and its connection) for ever; now the whole drain ends at the
    idle timeout."""
    from hydra_trio.http.plumbing import drain_body

    idle_s = 10.0

    async def drip() -> dict[str, Any]:
        await trio.sleep(idle_s * 0.9)
        return {"type": "http.request", "body": b"x", "more_body": True}

    t0 = trio.current_time()
    with trio.fail_after(idle_s * 100):
        await drain_body(drip, 1 << 30, idle_s)
    assert trio.current_time() - t0 == pytest.approx(idle_s)


@pytest.mark.parametrize(
    "raw", ["%C2%B2", "%C2%B9", "%D9%A1", "%EF%BC%91", "%201", "1_0", "+1", "-1", "0x1", "12345678901"]
)
async def test_slot_ids_that_are_not_ascii_digits_are_400_everywhere(
    start_engine: Any, tiny_model: Path, raw: str
) -> None:
    """'²', '¹', Arabic-Indic and full-width digits pass str.isdigit() (some int() too): every
    slot route answers 400, never a 500; so does a decode id of them."""
    ep = await start_engine(tiny_model, **ENGINE)
    async with http(ep) as h:
        for method, path in (
            ("GET", f"/slots/{raw}/state/meta"),
            ("GET", f"/slots/{raw}/state"),
            ("POST", f"/slots/{raw}?action=erase"),
            ("GET", f"/v1/decode/{raw}"),
            ("DELETE", f"/v1/decode/{raw}"),
        ):
            r = await h.request(method, path)
            assert r.status_code == 400, (method, path, r.status_code, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        r = await h.put(f"/slots/{raw}/state", content=b"\x02" + b"\0" * 20, headers=OCTETS)
        assert r.status_code == 400, r.text


async def test_erase_takes_llama_servers_json_body(start_engine: Any, tiny_model: Path) -> None:
    """llama-server's slot API takes a JSON body on erase ({}), and its clients send one: so
    does this one, up to a small cap; past it 413, and a body that is not a JSON object 400."""
    ep = await start_engine(tiny_model, **ENGINE)
    await state_blob(ep)
    async with http(ep) as h:
        r = await h.post("/slots/0?action=erase", json={})
        assert r.status_code == 200, r.text
        assert (await h.get("/slots/0/state/meta")).json()["n_past"] == 0
        assert (await h.post("/slots/0?action=erase")).status_code == 200  # no body, as before
        assert (await h.post("/slots/0?action=erase", json={"id_slot": 0})).status_code == 200
        assert (await h.post("/slots/0?action=erase", content=b"{" * 10)).status_code == 400
        assert (await h.post("/slots/0?action=erase", json={"pad": "x" * 5000})).status_code == 413
