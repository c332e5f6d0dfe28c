"""Helpers shared by the route modules: app state, JSON responses, error mapping."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import ExitStack, asynccontextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

import trio
from quart import Response, current_app, request
from werkzeug.exceptions import HTTPException

from ...wire.errors import ErrorCode, ParamError, PromptTooLong, ProtocolError, Status
from ...wire.jsontext import SLICED_MIN_CHARS, parse_json, parse_json_object, parse_json_sliced
from .sse import RETRY_AFTER, busy_body, error_body

if TYPE_CHECKING:

    from ...config import Settings
    from ...engine import Engine
    from ...serving import AppState

_HTTP_STATUS = {
    Status.BAD_REQUEST: 400,
    Status.NOT_FOUND: 404,
    Status.BUSY: 503,
    Status.NOT_IMPLEMENTED: 501,
    Status.ERROR: 500,
}
# Codes whose RPC status (ERROR) would read as the engine's fault over HTTP, but are the caller's:
_CODE_STATUS = {
    ErrorCode.TOO_LARGE: 413,
    # A well-formed blob whose contents llama.cpp (or the context size) refuses for this
    # model: understood, not processable (BAD_FRAME, a malformed blob, stays 400).
    ErrorCode.RESTORE_FAILED: 422,
    # KV from another model: valid in itself, in conflict with the model this engine holds
    # (it would succeed on an engine with the matching model).
    ErrorCode.CAP_MISMATCH: 409,
}


def http_status(err: ProtocolError) -> int:
    if isinstance(err, PromptTooLong):  # the 400 agents compact their conversation on
        return 400
    return _CODE_STATUS.get(err.code) or _HTTP_STATUS.get(err.status, 500)


def app_state() -> AppState:
    return current_app.config["HYDRA_STATE"]


# The nursery of the HTTP request being handled (see server.py): work that belongs to one
# request, such as a streaming completion's producer, lives and dies with it.
_request_nursery: ContextVar[trio.Nursery] = ContextVar("hydra_request_nursery")


def request_nursery() -> trio.Nursery:
    return _request_nursery.get()


def set_request_nursery(nursery: trio.Nursery) -> None:
    _request_nursery.set(nursery)


# What an HTTP exchange holds until its last byte, when the request's nursery (a stream's
# producer included) has ended: its model (http/plumbing/model_choice.py). The ASGI wrapper that counts
# the exchanges in flight (server.py) opens and closes it.
request_holds: ContextVar[ExitStack] = ContextVar("hydra_request_holds")


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return Response(body, status=status, content_type="application/json", headers=headers)


def busy_reply(message: str, **extra: Any) -> Response:
    """The one "busy, retry" reply of every HTTP route: 503 with Retry-After."""
    return json_response(busy_body(message, **extra), 503, RETRY_AFTER)


class EngineStarting(Exception):
    pass


def require_engine() -> Engine:
    engine = app_state().engine
    if engine is None:
        raise EngineStarting
    return engine


def client_request_id() -> str:
    """The client's X-Request-Id (a router's one id for both P/D stages), for the logs of
    every engine it touched; echoed on the response. Empty when none was sent."""
    return (request.headers.get("X-Request-Id") or "")[:200]


def generation_owner(completion_id: str) -> str:
    """What a generation is called in slot owners and log lines: its completion id, and the
    client's request id when it sent one."""
    rid = client_request_id()
    return f"http:{completion_id}" + (f" (X-Request-Id {rid})" if rid else "")


async def receive_body(settings: Settings, take: Callable[[bytes], None]) -> int:
    """Hand the request body to ``take`` chunk by chunk as it arrives; returns its size.

    Every body read obeys two limits, so a sender cannot hold its buffer (or its share of the
    payload budget) by sending slowly: no chunk for --idle-timeout-s, or less than
    --min-upload-bytes-per-s on average once --upload-grace-s is over (``t`` seconds in, at
    least ``(t - grace) * rate`` bytes: a body of N bytes gets grace + N / rate at most), is
    answered 408. The clock starts here: a body the route holds back (hold_state_uploads)
    waits in the socket on the engine's account, not the sender's."""
    rate = settings.min_upload_bytes_per_s
    start = last = trio.current_time()
    got = 0
    chunks = aiter(request.body)
    while True:
        deadline = last + settings.idle_timeout_s
        if rate:
            deadline = min(deadline, start + settings.upload_grace_s + got / rate)
        with trio.move_on_at(deadline) as wait:
            chunk = await anext(chunks, None)
        if wait.cancelled_caught:
            declared = request.content_length
            of = f" of {declared}" if declared is not None else ""
            raise HttpError(
                408,
                f"request body too slow: {got}{of} bytes in {trio.current_time() - start:.1f} s "
                f"(at most {settings.idle_timeout_s:g} s without a byte; at least {rate} bytes/s "
                f"after {settings.upload_grace_s:g} s: --idle-timeout-s, --min-upload-bytes-per-s, --upload-grace-s)",
                "invalid_request_error",
                headers={"Connection": "close"},
            )
        if chunk is None:
            return got
        last = trio.current_time()
        got += len(chunk)
        take(chunk)


async def drain_body(receive: Callable[[], Awaitable[dict[str, Any]]], limit: int, idle_timeout_s: float) -> None:
    """Drop a refused request's body, up to ``limit`` bytes, so the refusal can be read. One
    deadline for the whole drain (``idle_timeout_s``), not only per message: a sender
    dripping a byte just inside the idle timeout would otherwise hold it for ever."""
    left = limit
    with trio.move_on_after(idle_timeout_s):
        while left > 0:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            left -= len(message.get("body", b""))


# ---- admission: how much request work runs at once ------------------------------------------------

# Routes that need no slot (count_tokens, input_tokens, the tokenizer and render routes) would
# otherwise run as many at once as clients send, each parsing, rendering and tokenizing a body
# of up to the prompt cap: at most this many run; the others wait --slot-wait-s, then get the
# one "busy, retry" reply (503, Retry-After; Anthropic's overloaded_error on its routes).
SLOTLESS_AT_ONCE = 4
# Bodies past this many bytes are parsed (once received) this many at a time: a 13.6 MB body of
# tiny messages is ~120 MB of objects while parsed (two at once: +236 MB); smaller ones never wait.
BIG_BODY_BYTES = 1 << 20
BIG_BODIES_AT_ONCE = 1
# A request's Python work on its body (a codec's mapping, a render) goes to a thread past this
# many body bytes: there it shares the GIL in 5 ms turns instead of holding the event loop.
OFF_LOOP_BODY_BYTES = 64 << 10
_body_bytes: ContextVar[int] = ContextVar("hydra_request_body_bytes", default=0)


class _Admission:
    def __init__(self) -> None:
        self.slotless = trio.CapacityLimiter(SLOTLESS_AT_ONCE)
        self.big_bodies = trio.CapacityLimiter(BIG_BODIES_AT_ONCE)


def _admission() -> _Admission:
    """The app's admission (one per app: created with its first request)."""
    found: _Admission | None = current_app.config.get("HYDRA_ADMISSION")
    if found is None:
        found = current_app.config["HYDRA_ADMISSION"] = _Admission()
    return found


@asynccontextmanager
async def _admitted(limiter: trio.CapacityLimiter, what: str) -> AsyncIterator[None]:
    """Hold one of ``limiter``'s places for the block, waiting --slot-wait-s at most."""
    wait_s = app_state().settings.slot_wait_s
    with trio.move_on_after(wait_s) as waited:
        await limiter.acquire()
    if waited.cancelled_caught:
        raise HttpError(
            503, f"{what}: all {int(limiter.total_tokens)} places are taken (waited {wait_s:g} s); retry",
            "unavailable_error", headers=dict(RETRY_AFTER),
        )
    try:
        yield
    finally:
        limiter.release()


R = TypeVar("R")


def needs_no_slot(view: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """A route that does prompt work without a slot: at most SLOTLESS_AT_ONCE run at once."""

    @functools.wraps(view)
    async def admitted_view(*args: Any, **kwargs: Any) -> R:
        async with _admitted(_admission().slotless, f"{request.path[:100]} (needs no slot)"):
            return await view(*args, **kwargs)

    return admitted_view


async def off_loop(fn: Callable[[], R]) -> R:
    """``fn()`` (Python work on the request's body) on a thread when the body was large, so
    that it shares the GIL with the event loop instead of holding it; inline when small."""
    if _body_bytes.get() < OFF_LOOP_BODY_BYTES:
        return fn()
    return await trio.to_thread.run_sync(fn)


async def read_request_json(*, token_ids: bool = False) -> dict[str, Any]:
    """A prompt route's JSON body (completions, chat, tokenizer and template routes): at most
    --max-json-bytes, and at most what a request for one slot can use (``Engine.
    max_request_json_bytes``); with ``token_ids`` (/detokenize: an array of ids), at most
    what an array of every KV cell's id takes (``Engine.max_token_ids_json_bytes``). Bigger
    is refused before it is parsed: parsing holds the GIL, so a 12 MB array of token ids
    (0.2-0.45 s) would stall every stream, and its Python objects take several times its
    bytes."""
    state = app_state()
    engine = state.engine
    cap, why = state.settings.max_json_bytes, "--max-json-bytes"
    if engine is not None:
        limit = engine.json_body_limit(token_ids=token_ids)
        if limit < cap:
            cap = limit
            why = (
                f"the most an array of {engine.n_ctx} token ids (every KV cell) takes"
                if token_ids
                else f"the most a request for a slot of {engine.n_ctx_slot} positions can use"
            )
    body = await read_json_body(cap, why)
    if engine is not None and not token_ids:
        check_turns(engine, body)
    return body


def check_turns(engine: Engine, body: dict[str, Any]) -> None:
    """Each turn renders to a token at least: more turns than a slot has positions cannot
    fit, and refused now they are never mapped, rendered or tokenized (a 13 MB body of tiny
    messages took ~1 s and +576 MB through those before its refusal)."""
    for key in ("messages", "input"):
        items = body.get(key)
        if isinstance(items, list) and len(items) >= engine.n_ctx_slot:
            raise PromptTooLong(
                f"{key} holds {len(items)} turns; a slot holds "
                f"{engine.n_ctx_slot} positions and each turn takes one at least"
            )


async def read_json_body(max_bytes: int, why: str = "--max-json-bytes", *, any_value: bool = False) -> Any:
    """The request's JSON object (``any_value``: any JSON value), at most ``max_bytes``
    (``why``: what sets it), declared or not: a chunked body is counted as it arrives and
    refused (413) once past the limit, not buffered to Quart's own cap first; a slow one
    gets 408 (receive_body). A large body is parsed in slices on the event loop, one over
    BIG_BODY_BYTES at a time."""
    declared = request.content_length
    if declared is not None and declared > max_bytes:  # refuse before reading it
        raise HttpError(413, f"body is {declared} bytes; the limit is {max_bytes} ({why})", "invalid_request_error")
    chunks: list[bytes] = []
    size = 0

    def take(chunk: bytes) -> None:
        nonlocal size
        size += len(chunk)
        if size > max_bytes:
            raise HttpError(413, f"body is over {max_bytes} bytes, the limit ({why})", "invalid_request_error")
        chunks.append(chunk)

    await receive_body(app_state().settings, take)
    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    _body_bytes.set(len(data))
    try:  # the RPC paths' rule (wire/jsontext.py); every refusal is the client's 400
        if len(data) < SLICED_MIN_CHARS:
            return parse_json(data, "JSON body") if any_value else parse_json_object(data, "JSON body")
        if len(data) <= BIG_BODY_BYTES:
            return await _parse_sliced(data, any_value=any_value)
        # (admitted once received: a slow sender holds no place while it sends)
        async with _admitted(_admission().big_bodies, f"parsing bodies over {BIG_BODY_BYTES} bytes"):
            return await _parse_sliced(data, any_value=any_value)
    except ProtocolError as err:
        raise HttpError(400, err.message, "invalid_request_error") from None


async def _parse_sliced(data: bytes, *, any_value: bool = False) -> Any:
    """A large body parsed in slices with the event loop's other work between them: json's
    C parser holds the GIL for a whole call, on any thread (a 13 MB body of tiny objects
    held every stream ~1 s). An object unless ``any_value``."""
    try:
        text = str(data, "utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_JSON, f"JSON body: invalid JSON: {exc}") from None
    steps = parse_json_sliced(text, "JSON body")
    while True:
        try:
            next(steps)
        except StopIteration as done:
            value = done.value
            break
        await trio.lowlevel.checkpoint()
    if not any_value and not isinstance(value, dict):
        raise ProtocolError(ErrorCode.BAD_JSON, f"JSON body: expected a JSON object, got {type(value).__name__}")
    return value


class HttpError(Exception):
    def __init__(
        self, status: int, message: str, kind: str, headers: dict[str, str] | None = None, **extra: Any
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.headers = headers
        self.extra = extra


def register_error_handlers(app: Any) -> None:
    @app.errorhandler(ProtocolError)
    async def _protocol_error(err: ProtocolError) -> Response:
        status = http_status(err)
        if status == 503:  # RPC's BUSY: the one "busy, retry" reply
            return busy_reply(err.message, error_code=str(err.code), **err.extra)
        kind = "invalid_request_error" if status < 500 else "server_error"
        param = err.param if isinstance(err, ParamError) else None
        body = error_body(status, err.message, kind, param=param, error_code=str(err.code), **err.extra)
        if isinstance(err, PromptTooLong):  # OpenAI's code, the one agents recognise (issue 40)
            body["error"].update(code="context_length_exceeded", param="messages")
        return json_response(body, status)

    @app.errorhandler(HttpError)
    async def _http_error(err: HttpError) -> Response:
        return json_response(error_body(err.status, err.message, err.kind, **err.extra), err.status, err.headers)

    @app.errorhandler(EngineStarting)
    async def _starting(_err: EngineStarting) -> Response:
        return busy_reply("model is loading")

    @app.errorhandler(HTTPException)
    async def _werkzeug(err: HTTPException) -> Response:
        code = err.code or 500
        # OpenAI's words for an unknown route (Anthropic's shape on /v1/messages*: http/messages/).
        message = f"Invalid URL ({request.method} {request.path[:200]})" if code == 404 else err.description or err.name
        return json_response(error_body(code, message, "invalid_request_error"), code)

    @app.errorhandler(Exception)
    async def _internal(err: Exception) -> Response:
        app_state().log.exception("unhandled error in %s %s", request.method, request.path, exc_info=err)
        return json_response(error_body(500, f"internal error: {type(err).__name__}", "server_error"), 500)


