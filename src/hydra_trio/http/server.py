"""Builds the Quart-Trio app and serves it with Hypercorn inside the caller's nursery."""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import logging
import resource
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import quart.app
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from quart import Response, request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection

from ..concurrency import Started, leaves
from . import decode_results, infill, models, pooling, sessions, slots, status, tokenizer
from .completions import CHAT, TEXT
from .generation import Dialect, dialect_blueprint, error_in_shape
from .messages import MESSAGES
from .plumbing import (
    busy_reply,
    client_request_id,
    connections,
    drain_body,
    install_auth,
    register_error_handlers,
    request_holds,
    routes,
    set_request_nursery,
)
from .responses import RESPONSES

if TYPE_CHECKING:
    from ..serving import AppState

log = logging.getLogger(__name__)

# Every generation route's API: its routes (the one dialect route each), and its error shape
# on its paths, also for a body refused before the app sees it.
DIALECTS: tuple[Dialect, ...] = (CHAT, TEXT, MESSAGES, RESPONSES)

# ---- the seam: quart-trio's private parts this module relies on --------------------------------
# quart-trio has no hook for its per-request nursery, so _RequestNurseryConnection re-writes
# TrioASGIHTTPConnection.__call__ (four lines) around Quart's private _create_request_from_scope.
# pyproject.toml pins the versions this was written against; check_quart_trio_seam() (run by
# create_app, before anything is served) checks every member, and that upstream's __call__
# still does only what the copy does, so another version fails at once, by name, instead of
# serving requests built another way (as http/plumbing/connections.py does for Hypercorn's seam).
QUART_TRIO_TESTED = "quart-trio>=0.12,<0.13"
QUART_TESTED = "quart>=0.22,<0.23"
# Every global and attribute name upstream's __call__ uses: more (or fewer) means it changed.
_UPSTREAM_CALL_NAMES = frozenset(
    {"_create_request_from_scope", "trio", "open_nursery", "start_soon", "handle_messages", "handle_request"}
)


class QuartTrioSeamError(RuntimeError):
    """The installed quart-trio (or Quart) lacks a private member the app relies on."""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _params(fn: Any) -> list[str] | None:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _quart_trio_seam_missing() -> list[str]:
    """The private members of quart-trio and Quart that ``_RequestNurseryConnection`` relies on
    that are missing or of another kind than expected (empty: all there)."""
    missing: list[str] = []

    def need(ok: Any, what: str) -> None:
        if not ok:
            missing.append(what)

    conn = TrioASGIHTTPConnection
    upstream = getattr(conn.__dict__.get("__call__"), "__code__", None)
    need(
        upstream is not None and frozenset(upstream.co_names) == _UPSTREAM_CALL_NAMES,
        "TrioASGIHTTPConnection.__call__ (builds the request, then runs handle_messages and "
        "handle_request in one nursery, nothing else)",
    )
    create = getattr(conn, "_create_request_from_scope", None)
    need(
        callable(create) and not inspect.iscoroutinefunction(create) and _params(create) == ["self", "send"],
        "TrioASGIHTTPConnection._create_request_from_scope(self, send) (a plain method)",
    )
    for name, last in (("handle_messages", "receive"), ("handle_request", "send")):
        fn = getattr(conn, name, None)
        need(
            inspect.iscoroutinefunction(fn) and _params(fn) == ["self", "nursery", "request", last],
            f"TrioASGIHTTPConnection.{name}(self, nursery, request, {last}) (a coroutine function)",
        )
    need(QuartTrio.__dict__.get("asgi_http_class") is conn, "QuartTrio.asgi_http_class (TrioASGIHTTPConnection)")
    asgi_app = getattr(quart.app.Quart, "asgi_app", None)
    need(
        "asgi_http_class" in getattr(getattr(asgi_app, "__code__", None), "co_names", ()),
        "Quart.asgi_app (a method that looks asgi_http_class up per request)",
    )
    return missing


def check_quart_trio_seam() -> None:
    """Raise QuartTrioSeamError naming what is missing when the installed quart-trio or Quart
    is not one ``_RequestNurseryConnection`` was written against."""
    missing = _quart_trio_seam_missing()
    if missing:
        raise QuartTrioSeamError(
            f"quart-trio {_version('quart-trio')} (Quart {_version('quart')}) is not one "
            f"hydra-trio's HTTP app works with (tested: {QUART_TRIO_TESTED}, {QUART_TESTED}): "
            f"missing or changed: {'; '.join(missing)}"
        )


class _RequestNurseryConnection(TrioASGIHTTPConnection):
    """quart-trio's HTTP connection, with its per-request nursery made available to the
    route (``common.request_nursery()``). That nursery is cancelled when the client goes
    away or the response has been sent, so what a route starts in it ends with its request.
    A copy of upstream's ``__call__`` plus one line: the seam above checks it still matches."""

    async def __call__(self, receive: Any, send: Any) -> None:
        request_ = self._create_request_from_scope(send)
        async with trio.open_nursery() as nursery:
            set_request_nursery(nursery)  # copied into the two tasks' contexts below
            nursery.start_soon(self.handle_messages, nursery, request_, receive)
            nursery.start_soon(self.handle_request, nursery, request_, send)


class _App(QuartTrio):
    asgi_http_class = _RequestNurseryConnection


def create_app(state: AppState) -> QuartTrio:
    check_quart_trio_seam()  # before anything is served: a clear error if quart-trio changed
    app = _App("hydra_trio")
    app.config["HYDRA_STATE"] = state
    # Streams (SSE) may run far longer than Quart's 60 s default; bodies may be KV blobs.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 600
    app.config["MAX_CONTENT_LENGTH"] = max(state.settings.max_kv_bytes, state.settings.max_json_bytes) + (1 << 20)
    for dialect in DIALECTS:
        app.register_blueprint(dialect_blueprint(dialect))
    for api in (status, slots, decode_results, tokenizer, pooling, infill, models, sessions):
        for bp in api.BLUEPRINTS:
            app.register_blueprint(bp)
    register_error_handlers(app)
    install_auth(app, state)
    app.asgi_app = slots.hold_state_uploads(app.asgi_app, state.settings)  # type: ignore[method-assign,assignment]
    app.asgi_app = _limit_request_bodies(app.asgi_app, state)  # type: ignore[method-assign,assignment]
    app.asgi_app = _count_in_flight(app.asgi_app, state)  # type: ignore[method-assign,assignment]

    @app.before_request
    async def refuse_new_work_while_draining() -> Response | None:
        route = routes.by_path(request.method, request.path)
        if state.draining and route is not None and route.new_work:
            return busy_reply("engine is draining for shutdown: send new requests elsewhere")
        return None

    @app.after_request
    async def count(response: Response) -> Response:
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        state.metrics.http_requests.labels(rule, str(response.status_code)).inc()
        if rid := client_request_id():
            response.headers["X-Request-Id"] = rid
        return response

    return app


def body_cap(method: str, path: str, state: AppState) -> int:
    """The largest request body a route takes (http/plumbing/routes.py), decided before the app sees
    the request: a slot state upload up to --max-kv-bytes, JSON up to --max-json-bytes (the
    prompt routes refine it: common.read_request_json), everything else none; a POST to no
    route is capped as JSON (its 404 is answered after the body). Quart buffers
    whatever body comes with any request, read by the route or not, up to its one
    MAX_CONTENT_LENGTH (the largest of these): a GET with a body would sit in memory for as
    long as its response runs (a stream: minutes)."""
    settings = state.settings
    route = routes.by_path(method, path)
    body = (
        "json" if route is None and method in ("POST", "PUT", "PATCH") else route.body if route is not None else "none"
    )
    caps = {"kv": settings.max_kv_bytes, "json": settings.max_json_bytes, "small": routes.SMALL_BODY_BYTES, "none": 0}
    return caps[body]


def _limit_request_bodies(asgi_app: Any, state: AppState) -> Any:
    """ASGI wrapper: a body larger than its route's ``body_cap`` (declared; or any chunked
    body for a route that takes none) is refused 413 before the app or Quart's buffer sees
    a byte of it, and the connection closed. Chunked bodies for routes that take one are
    counted by the route as they arrive (common.read_json_body)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await asgi_app(scope, receive, send)
            return
        cap = body_cap(scope["method"], scope["path"], state)
        declared, chunked = None, False
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit():
                declared = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if (declared or 0) <= cap and not (chunked and cap == 0):
            await asgi_app(scope, receive, send)
            return
        size = f"{declared} bytes" if declared is not None else "a chunked body"
        what = "takes no body" if cap == 0 else f"takes at most {cap} bytes"
        message = f"{scope['method']} {scope['path'][:100]} {what}; got {size}"
        # Answered before the app: each dialect's shape here (as its after-request hook gives it there).
        shaped = error_in_shape(DIALECTS, scope["path"], 413, message)
        body = json.dumps(shaped).encode()
        async with trio.open_nursery() as nursery:
            # Unread, the body would keep Hypercorn's queue to the app full and our reply's
            # last send waiting behind it: drop what comes (bounded) while the reply goes out.
            nursery.start_soon(drain_body, receive, state.settings.drain_limit_bytes, state.settings.idle_timeout_s)
            await send(
                {
                    "type": "http.response.start",
                    "status": 413,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body, "more_body": False})
        state.metrics.http_requests.labels("body_cap", "413").inc()

    return app


def _count_in_flight(asgi_app: Any, state: AppState) -> Any:
    """ASGI wrapper: HTTP exchanges in flight, from the request until the last body byte (a
    streaming response outlives its route and its slot), for the shutdown drain; and what the
    exchange holds that long (``common.request_holds``: its model), let go after its last task."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await asgi_app(scope, receive, send)
            return
        state.http_in_flight += 1
        try:
            with ExitStack() as holds:
                token = request_holds.set(holds)
                try:
                    await asgi_app(scope, receive, send)
                finally:
                    request_holds.reset(token)
        finally:
            state.http_in_flight -= 1

    return app


async def serve_http(state: AppState, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    config = Config()
    config.bind = [f"{state.settings.host}:{state.settings.port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 2.0
    # An HTTP connection with no request in progress (also one that never sends a byte) is
    # closed after this, and its descriptor released: idle connections cannot pile up.
    # (Not Hypercorn's read_timeout: a client reading a long SSE stream sends nothing.)
    config.keep_alive_timeout = state.settings.http_idle_timeout_s
    # At most --max-http-connections; past it, a reserve answers /health (http/plumbing/connections.py).
    file_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    connections.install()  # the one patch of Hypercorn (checked: a clear error if it changed)
    connections.attach(config, state, lambda: status.health_reply(state), file_limit)
    app = create_app(state)

    # Hypercorn reports its binds ("host:port"); our caller wants the port.
    started = Started(lambda binds: task_status.started(int(binds[0].rsplit(":", 1)[1])))
    try:
        await serve(app, config, task_status=started, mode="asgi")  # type: ignore[arg-type]
    except BaseException as exc:
        found = leaves(exc)
        if len(found) == 1 and isinstance(found[0], OSError):  # e.g. the port is taken
            raise OSError(found[0].errno, f"HTTP {config.bind[0]}: {found[0].strerror}") from None
        raise
