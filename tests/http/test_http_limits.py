"""Connection floods and slow bodies: HTTP connections are bounded (--max-http-connections),
with a reserve that keeps /health answering past the bound, and a request body slower than
--min-upload-bytes-per-s (after --upload-grace-s) is cut off with 408 and its budget freed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import trio

from helpers import ENGINE, http, rpc, wait_until
from hydra_trio.config import Settings, settings_from
from hydra_trio.http.plumbing.connections import (
    AUTO_MAX_CONNECTIONS,
    OVERFLOW_RESERVE,
    connection_bound,
)

BOUND = 8
# More than the bound and the reserve together: the reserve's oldest are closed to make room.
FLOOD = BOUND + OVERFLOW_RESERVE + 40


def sample(ep: Any, name: str) -> float:
    return ep.state.metrics.registry.get_sample_value(name) or 0.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_health_answers_while_idle_connections_flood_past_the_bound(
    start_engine: Any, tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model, max_http_connections=BOUND, **ENGINE)
    fds_before = open_fds()
    flood = [
        await trio.open_tcp_stream("127.0.0.1", ep.http_port) for _ in range(FLOOD)
    ]  # no byte sent
    try:
        # Every one is accepted (none waits in the backlog, where a probe would queue behind
        # it): the bound's worth are served, the reserve holds the newest of the rest.
        await wait_until(lambda: sample(ep, "hydra_http_connections_accepted_total") == FLOOD)
        assert sample(ep, "hydra_http_connections") == BOUND
        assert sample(ep, "hydra_http_connections_overflow") <= OVERFLOW_RESERVE
        async with http(ep) as h:
            with trio.fail_after(1):
                r = await h.get("/health")
            assert r.status_code == 200, r.text
            assert r.json()["status"] == "ok"
            assert r.headers["connection"] == "close"  # answered by the reserve
        async with http(ep) as h:
            r = await h.get("/v1/models")
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "unavailable_error"
            assert "--max-http-connections" in r.json()["error"]["message"]
        assert sample(ep, "hydra_http_connections") == BOUND  # the idle ones are still held
        async with await rpc(ep) as c:  # RPC has its own listener and bound
            assert (await c.info()).ok
    finally:
        for stream in flood:
            await stream.aclose()
    # A closed peer's descriptor is released at once, past the bound or not.
    await wait_until(
        lambda: (
            sample(ep, "hydra_http_connections") == 0
            and sample(ep, "hydra_http_connections_overflow") == 0
        ),
        timeout_s=2.0,
    )
    await wait_until(lambda: open_fds() <= fds_before, timeout_s=2.0)
    async with http(ep) as h:
        r = await h.get("/v1/models")
        assert r.status_code == 200, r.text
        assert r.headers.get("connection") != "close"  # served by Hypercorn again
        assert (await h.get("/health")).status_code == 200


async def test_a_silent_connection_past_the_bound_is_closed_without_an_answer(
    start_engine: Any, tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model, max_http_connections=1, **ENGINE)
    held = await trio.open_tcp_stream("127.0.0.1", ep.http_port)
    try:
        await wait_until(lambda: sample(ep, "hydra_http_connections") == 1)
        silent = await trio.open_tcp_stream("127.0.0.1", ep.http_port)
        with trio.fail_after(10):  # after OVERFLOW_HEAD_S
            assert await silent.receive_some(100) == b""
        await silent.aclose()
        assert sample(ep, "hydra_http_connections_overflow_answered_total") == 0
    finally:
        await held.aclose()


def test_the_default_bound_comes_from_the_open_file_limit() -> None:
    s = Settings()
    assert connection_bound(s, 1024) == 1024 - s.max_connections - OVERFLOW_RESERVE - 256
    assert connection_bound(s, 1 << 20) == AUTO_MAX_CONNECTIONS
    assert connection_bound(s, 100) == 16  # a tiny limit still serves a few
    assert connection_bound(Settings(max_http_connections=5), 1 << 20) == 5
    assert settings_from(env={"HYDRA_MAX_HTTP_CONNECTIONS": "12"}).max_http_connections == 12
    assert settings_from(env={"HYDRA_MIN_UPLOAD_BYTES_PER_S": "0"}).min_upload_bytes_per_s == 0
    for bad in (
        {"max_http_connections": -1},
        {"min_upload_bytes_per_s": -1},
        {"upload_grace_s": 0},
    ):
        with pytest.raises(SystemExit, match=next(iter(bad))):
            settings_from(env={}, **bad)


# ---- slow bodies ------------------------------------------------------------------------------


async def raw_exchange(
    ep: Any, head: str, body: bytes, *, trickle_s: float | None = None
) -> tuple[int, dict[str, Any], float]:
    """Send ``head`` and ``body`` (a byte every ``trickle_s`` when given, else at once, then
    nothing); return the reply's status and JSON body once the engine has closed the
    connection, and the seconds that took."""
    stream = await trio.open_tcp_stream("127.0.0.1", ep.http_port)
    start = trio.current_time()
    reply = bytearray()
    async with stream, trio.open_nursery() as nursery:

        async def send() -> None:
            await stream.send_all(head.encode())
            if trickle_s is None:
                await stream.send_all(body)
                return
            for i in range(len(body)):
                await stream.send_all(body[i : i + 1])
                await trio.sleep(trickle_s)  # the pace of the trickle, not a synchronisation

        nursery.start_soon(send)
        with trio.fail_after(20):
            while chunk := await stream.receive_some(65536):
                reply += chunk
        nursery.cancel_scope.cancel()  # a trickle still going: the engine has closed
    elapsed = trio.current_time() - start
    head_bytes, _, payload = bytes(reply).partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    return status, json.loads(payload), elapsed


STATE_PUT = (
    "PUT /slots/1/state HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\ncontent-length: {n}\r\n\r\n"
)
CHAT = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {n}\r\n\r\n"


async def test_a_stalled_state_upload_gets_408_and_releases_its_budget(
    start_engine: Any, tiny_model: Path
) -> None:
    ep = await start_engine(
        tiny_model, upload_grace_s=0.3, min_upload_bytes_per_s=1_000_000, **ENGINE
    )
    budget = ep.state.payload_budget
    n = 100_000
    async with trio.open_nursery() as nursery:
        result: list[Any] = []

        async def upload() -> None:
            result.extend(await raw_exchange(ep, STATE_PUT.format(n=n), b"\x02" * 10))

        nursery.start_soon(upload)
        await wait_until(lambda: budget.used == n)  # room taken, the body is being read
    status, body, elapsed = result
    assert status == 408, body
    assert body["error"]["code"] == 408 and "--min-upload-bytes-per-s" in body["error"]["message"]
    assert budget.used == 0
    assert elapsed < 5  # grace + 10 bytes / rate, not --idle-timeout-s (120)
    async with http(ep) as h:  # the engine is unaffected
        assert (await h.get("/slots/1/state/meta")).status_code == 200


async def test_a_body_trickling_below_the_floor_gets_408_though_it_never_stalls(
    start_engine: Any, tiny_model: Path
) -> None:
    """A byte every 20 ms is never silent for --idle-timeout-s, yet is far below a floor of
    1,000 bytes/s: once the grace is over it is cut off (JSON routes as state uploads)."""
    ep = await start_engine(
        tiny_model, upload_grace_s=0.3, min_upload_bytes_per_s=1000, idle_timeout_s=60, **ENGINE
    )
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 500}]}).encode()
    status, reply, elapsed = await raw_exchange(ep, CHAT.format(n=len(body)), body, trickle_s=0.02)
    assert status == 408, reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert elapsed < 5  # not the 10 s the whole body would take
    async with http(ep) as h:
        r = await h.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert r.status_code == 200, r.text


# ---- response deadline and per-route body caps (issue 28, 1.4) -------------------------------


async def test_a_state_reader_that_stops_reading_loses_its_snapshot(
    start_engine: Any, wide_kv_model: Path
) -> None:
    """GET /slots/{id}/state to a client that never reads: past --download-grace-s + size /
    --min-download-bytes-per-s the connection is closed and the snapshot's budget released
    (Hypercorn's shielded send alone would hold it for as long as the client stays)."""
    import socket

    from test_http_state import state_blob

    ep = await start_engine(
        wide_kv_model, threads=1, slots=2, download_grace_s=0.5, min_download_bytes_per_s=1 << 30
    )
    blob = await state_blob(ep, 0, {"prompt": "hello world " * 60})
    assert len(blob) > 6 << 20  # more than the loopback socket buffers take
    budget = ep.state.payload_budget
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    await sock.connect(("127.0.0.1", ep.http_port))
    stream = trio.SocketStream(sock)
    async with stream:
        await stream.send_all(b"GET /slots/0/state HTTP/1.1\r\nhost: x\r\n\r\n")
        await wait_until(lambda: budget.used >= len(blob))  # the snapshot is held
        await wait_until(lambda: budget.used == 0)  # the deadline passed: released unread
        got = 0
        with trio.fail_after(10):
            try:
                while chunk := await stream.receive_some(1 << 20):
                    got += len(chunk)
            except trio.BrokenResourceError:
                pass  # a reset: closed with bytes unread, as it should be
        assert got < len(blob)  # the connection ended before the blob
    async with http(ep) as h:  # a reader that reads gets it whole
        assert len((await h.get("/slots/0/state")).content) == len(blob)
        assert budget.used == 0


@pytest.mark.parametrize(
    "head",
    [
        "GET /v1/models HTTP/1.1\r\nhost: x\r\ncontent-length: 4000000000\r\n\r\n",
        "GET /slots/0/state HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\n",
        "DELETE /v1/decode/1 HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n",
        "GET /health HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n",
        "POST /slots/0?action=erase HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n",
        "POST /tokenize HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1001\r\n\r\n",
        "PUT /slots/0/state HTTP/1.1\r\nhost: x\r\ncontent-length: 2001\r\n\r\n",
    ],
    ids=["get_4gb", "state_get", "delete", "chunked_get", "erase", "json_over", "state_put_over"],
)
async def test_a_body_past_its_routes_cap_is_refused_unread(start_engine: Any, tiny_model: Path, head: str) -> None:
    """A route that takes no body (GETs, DELETE, erase) refuses any at once, a JSON route one
    past --max-json-bytes, a state upload one past --max-kv-bytes: 413 before a byte of the
    body is read (Quart would buffer it all, up to its one cap, ~4 GiB by default)."""
    ep = await start_engine(tiny_model, max_json_bytes=1000, max_kv_bytes=2000, **ENGINE)
    status, body, _ = await raw_exchange(ep, head, b"")
    assert status == 413, body
    assert body["error"]["code"] == 413
    async with http(ep) as h:  # the engine is unaffected; bodies within the caps are served
        assert (await h.get("/v1/models")).status_code == 200
        assert (await h.post("/tokenize", json={"content": "hi"})).status_code == 200


async def test_detokenize_refuses_more_ids_than_the_cells_unparsed(start_engine: Any, tiny_model: Path) -> None:
    """A /detokenize body longer than every KV cell's id takes is refused before it is read
    or parsed (its parse would hold the GIL: every stream's time), though the prompt routes'
    cap would let it in; one of n_ctx ids is served."""
    ep = await start_engine(tiny_model, **ENGINE)
    engine = ep.state.engine
    assert engine._core.inputs.max_token_ids_json_bytes < engine._core.inputs.max_request_json_bytes
    n = engine._core.inputs.max_token_ids_json_bytes + 1
    status, body, _ = await raw_exchange(
        ep, "POST /detokenize HTTP/1.1\r\nhost: x\r\ncontent-type: "
        f"application/json\r\ncontent-length: {n}\r\n\r\n", b""
    )
    assert status == 413 and "token ids" in body["error"]["message"], body
    async with http(ep) as h:
        r = await h.post("/detokenize", content=json.dumps({"tokens": [12] * engine.n_ctx}, indent=4))
        assert r.status_code == 200, r.text
