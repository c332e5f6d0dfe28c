"""A slot's state over HTTP (spec §6.5): its meta, GET and PUT of the v2 blob, and the gate
that keeps an upload's body in the socket until the payload budget has room for it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio
from quart import Blueprint, Response, request

from ...config import Settings
from ...serving import slot_state
from ...transport import payload_buffer
from ..plumbing import (
    HttpError,
    app_state,
    close_connection_after,
    drain_body,
    json_response,
    receive_body,
    request_nursery,
    require_engine,
    routes,
)
from .slot_routes import slot_id_of

bp = Blueprint("slot_state", __name__)

_CHUNK = 1 << 20  # GET sends the blob in slices of this size
_GATE = "hydra.upload_gate"  # ASGI scope key: set once the route has room for the body

ASGIReceive = Callable[[], Awaitable[dict[str, Any]]]
ASGISend = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[dict[str, Any], ASGIReceive, ASGISend], Awaitable[None]]


@bp.get("/slots/<raw_id>/state/meta")
async def state_meta(raw_id: str) -> Response:
    return json_response(slot_state.slot_meta(require_engine(), slot_id_of(raw_id)))


@bp.get("/slots/<raw_id>/state")
async def state_get(raw_id: str) -> Response:
    engine = require_engine()
    slot_id = slot_id_of(raw_id)
    state = app_state()
    budget = state.payload_budget
    settings = state.settings
    snap = await slot_state.snapshot(engine, slot_id, f"http:state_get:{slot_id}", budget, settings.idle_timeout_s)
    if settings.min_download_bytes_per_s:  # the read-rate floor: grace + size / rate at most
        deadline_s = settings.download_grace_s + snap.size / settings.min_download_bytes_per_s
        close_connection_after(request_nursery(), deadline_s, f"slot {slot_id} state ({snap.size} bytes)")
    return Response(
        _Chunks(snap.parts, lambda: budget.release(snap.held)),  # from the snapshot's own buffers
        status=200,
        content_type="application/octet-stream",
        headers={
            "Content-Length": str(snap.size),
            "X-Hydra-State-Size": str(snap.state_size),
            "X-Hydra-N-Past": str(snap.n_past),
            "X-Hydra-KV-Hash": snap.kv_hash,
        },
    )


class _Chunks:
    """The blob's bytes as a response body, no joined copy. ``done`` (releasing the
    snapshot's budget charge) runs once: when they are all sent, when the body is closed
    (the client left), or, for a body never started, when it is dropped."""

    def __init__(self, parts: list[bytes | bytearray], done: Callable[[], None]) -> None:
        self._views = iter(
            memoryview(part).cast("B")[off : off + _CHUNK] for part in parts for off in range(0, len(part), _CHUNK)
        )
        self._done: Callable[[], None] | None = done

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> memoryview:
        await trio.lowlevel.checkpoint()
        view = next(self._views, None)
        if view is None:
            self._finish()
            raise StopAsyncIteration
        return view

    async def aclose(self) -> None:
        self._finish()

    def _finish(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done()

    def __del__(self) -> None:
        self._finish()


@bp.put("/slots/<raw_id>/state")
async def state_put(raw_id: str) -> Response:
    """The body goes into one buffer of Content-Length bytes, taken from the payload budget
    RPC payloads use; the upload is held back (hold_state_uploads) until it has that room."""
    engine = require_engine()
    slot_id = slot_id_of(raw_id)
    engine.slot_info(slot_id)  # NO_SLOT before any byte is read
    state = app_state()
    settings = state.settings
    length = request.content_length
    if length is None:
        raise HttpError(411, "a Content-Length is required (the "
                        "blob is received into one buffer)", "invalid_request_error")
    if length > settings.max_kv_bytes:
        raise HttpError(413, f"blob of {length} bytes exceeds the cap of "
                        f"{settings.max_kv_bytes}", "invalid_request_error")
    async with state.payload_budget.held(length, within_s=settings.idle_timeout_s, what="a KV blob upload"):
        buf = payload_buffer(length)
        await _receive_into(memoryview(buf), settings)
        meta = await slot_state.restore(engine, slot_id, memoryview(buf), f"http:state_put:{slot_id}")
        del buf
    state.metrics.restore_bytes.inc(length)
    return json_response(meta, headers={"X-Hydra-N-Past": str(meta["n_past"])})


async def _receive_into(view: memoryview, settings: Settings) -> None:
    """Copy the request body into ``view`` as it arrives (a slow sender gets 408:
    receive_body)."""
    gate: trio.Event | None = request.scope.get(_GATE)
    if gate is not None:
        gate.set()  # room is taken: let the body in
    got = 0

    def take(chunk: bytes) -> None:
        nonlocal got
        if got + len(chunk) > len(view):
            raise HttpError(400, f"body is longer than its Content-Length {len(view)}", "invalid_request_error")
        view[got : got + len(chunk)] = chunk
        got += len(chunk)

    await receive_body(settings, take)
    if got != len(view):
        raise HttpError(400, f"body ended after {got} of {len(view)} bytes", "invalid_request_error")


def hold_state_uploads(asgi_app: ASGIApp, settings: Settings) -> ASGIApp:
    """ASGI wrapper: the body of PUT /slots/{id}/state is not read from the socket until the
    route has taken room for it from the payload budget.

    Quart reads every request body into its own buffer as soon as the request starts,
    whatever the route does; a blob waiting for room would sit there in full, outside the
    budget. Held back here instead, it waits in the socket (TCP pushes back on the sender)."""

    async def app(scope: dict[str, Any], receive: ASGIReceive, send: ASGISend) -> None:
        route = routes.by_path(scope["method"], scope["path"]) if scope["type"] == "http" else None
        if route is None or route.body != "kv":
            await asgi_app(scope, receive, send)
            return
        gate = trio.Event()

        async def gated_receive() -> dict[str, Any]:
            await gate.wait()
            return await receive()

        async with trio.open_nursery() as nursery:

            async def send_reply(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.body" and not message.get("more_body") and not gate.is_set():
                    # Refused unread (413, 503, ...). Hypercorn ends the exchange by queueing
                    # a disconnect for the app, behind the body parts it already read: with
                    # that queue full, this last send would never return. Drop the body as
                    # it comes (up to the drain limit, like RPC) while the reply goes out.
                    nursery.start_soon(drain_body, receive, settings.drain_limit_bytes, settings.idle_timeout_s)
                await send(message)

            await asgi_app({**scope, _GATE: gate}, gated_receive, send_reply)

    return app
