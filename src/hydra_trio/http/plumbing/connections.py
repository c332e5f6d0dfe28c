"""Bounded HTTP connections (--max-http-connections), with a reserve that keeps /health
answering while the bound is reached.

Hypercorn's trio worker builds its listeners from sockets and hands every accepted stream to
``TCPServer`` itself, with no public hook; that hand-off is the seam, so ``install`` (called
once by ``http/server.py`` before serving, after checking every private member relied on)
puts ``_GatedTCPServer`` there (behaving as Hypercorn's own for a config without a gate) and
``attach`` gives a config its gate. Every
connection is still accepted at once, so the backlog never fills with connections that no one
reads (a probe queued behind them would time out). Up to the bound, a connection is
Hypercorn's. Past it, it joins a small overflow reserve: the engine reads its request head
within a short deadline, answers ``GET /health`` as the route would (other requests get 503
with ``Retry-After``), always with ``Connection: close``, and closes it. When the reserve is
full the oldest connection in it is closed to make room: a flood of silent connections
cannot keep a probe, which sends its request at once, from being answered. HTTP thus holds
at most the bound plus ``OVERFLOW_RESERVE`` descriptors; RPC has its own bound
(--max-connections) and its own listener, counted apart in the default. The same handler
closes a connection as soon as its peer has closed, or its reply ended it (Hypercorn kept the
first until its idle timer, the second for as long as the peer kept it open).

The handler is also where a streamed response's chunks can skip Hypercorn: ``chunk_writer``
gives the current request's producer a way to write a chunk straight to the socket (see
``ChunkWriter``).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import logging
import os
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import h11
import hypercorn.trio.run
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from prometheus_client import CollectorRegistry, Counter, Gauge

from .sse import RETRY_AFTER, busy_body

if TYPE_CHECKING:
    from ...config import Settings
    from ...serving import AppState

log = logging.getLogger(__name__)

# Connections past the bound held at once, each until it has had its one answer.
OVERFLOW_RESERVE = 64
# How long a connection past the bound gets to send its request head (a probe sends it at
# once; a silent connection only holds its place in the reserve until then).
OVERFLOW_HEAD_S = 2.0
_MAX_HEAD = 8 * 1024  # a request head larger than this gets no answer
# The default bound: what the open-file limit leaves after RPC, the reserve and the engine's
# own descriptors (model files, KV pulls, logs, llama.cpp), at most AUTO_MAX_CONNECTIONS (each
# Hypercorn connection also costs memory).
_OWN_FILES = 256
AUTO_MAX_CONNECTIONS = 4096
_MIN_CONNECTIONS = 16

_GATE_ATTR = "hydra_connection_gate"


def connection_bound(settings: Settings, file_limit: int) -> int:
    """--max-http-connections, or (0) the default derived from the open-file limit."""
    if settings.max_http_connections > 0:
        return settings.max_http_connections
    spare = file_limit - settings.max_connections - OVERFLOW_RESERVE - _OWN_FILES
    return max(_MIN_CONNECTIONS, min(AUTO_MAX_CONNECTIONS, spare))


HealthReply = Callable[[], tuple[int, dict[str, Any], dict[str, str]]]


class ConnectionGate:
    """Counts HTTP connections; past ``bound`` it answers them itself (see the module doc)."""

    def __init__(self, bound: int, health: HealthReply, registry: CollectorRegistry) -> None:
        self.bound = bound
        self.open = 0  # connections Hypercorn serves
        self._health = health
        self._accepted = Counter(
            "hydra_http_connections_accepted", "HTTP connections accepted", registry=registry
        )
        self._answered = Counter(
            "hydra_http_connections_overflow_answered",
            "HTTP connections past --max-http-connections given their one answer",
            registry=registry,
        )
        Gauge("hydra_http_connections", "HTTP connections served", registry=registry).set_function(
            lambda: self.open
        )
        Gauge(
            "hydra_http_connections_overflow",
            "HTTP connections past --max-http-connections awaiting their one answer",
            registry=registry,
        ).set_function(lambda: self.overflow)
        # Connections in the overflow reserve, oldest first (dicts keep insertion order).
        self._overflow: dict[trio.CancelScope, None] = {}

    @property
    def overflow(self) -> int:
        return len(self._overflow)

    async def serve(
        self, stream: trio.SocketStream, serve_normally: Callable[[], Awaitable[None]]
    ) -> None:
        self._accepted.inc()
        if self.open < self.bound:
            self.open += 1
            try:
                await serve_normally()  # closes the stream before it returns
            finally:
                self.open -= 1
            return
        with trio.CancelScope() as scope:
            if len(self._overflow) >= OVERFLOW_RESERVE:
                oldest = next(iter(self._overflow))
                del self._overflow[oldest]
                oldest.cancel()  # its task closes its stream as it leaves the scope
            self._overflow[scope] = None
            try:
                await self._answer(stream)
            finally:
                self._overflow.pop(scope, None)
                await trio.aclose_forcefully(stream)  # released now, whatever the peer does

    async def _answer(self, stream: trio.SocketStream) -> None:
        with trio.move_on_after(OVERFLOW_HEAD_S):
            try:
                head = await _read_head(stream)
                if head is None:
                    return
                await stream.send_all(self._reply(head))
                self._answered.inc()
                # A close with unread bytes would send a reset, which can destroy the reply
                # before the client reads it: end our side, then read until the client closes
                # (it does at once: Connection: close), within the same deadline.
                await stream.send_eof()
                while await stream.receive_some(_MAX_HEAD):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return

    def _reply(self, head: bytes) -> bytes:
        # h11 (Hypercorn's parser) reads the head and frames the reply. A head it refuses
        # is no probe's: it gets the 503 (h11 lets a server answer a malformed request).
        conn = h11.Connection(h11.SERVER)
        conn.receive_data(head)
        try:
            request = conn.next_event()
        except h11.RemoteProtocolError:
            request = None
        if (
            isinstance(request, h11.Request)
            and request.method == b"GET"
            and request.target.split(b"?", 1)[0] == b"/health"
        ):
            status, body, headers = self._health()
        else:
            message = (
                f"engine busy: {self.open} HTTP connections are open, the limit (--max-http-connections); retry later"
            )
            status, body, headers = 503, busy_body(message), RETRY_AFTER
        head_only = isinstance(request, h11.Request) and request.method == b"HEAD"
        return _response(conn, status, body, headers, head_only=head_only)


async def _read_head(stream: trio.SocketStream) -> bytes | None:
    """The request head (request line and headers), or None when the peer closed first or
    sent more than _MAX_HEAD without ending it."""
    data = bytearray()
    while b"\r\n\r\n" not in data:
        if len(data) > _MAX_HEAD:
            return None
        chunk = await stream.receive_some(_MAX_HEAD)
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _response(
    conn: h11.Connection, status: int, body: dict[str, Any], headers: dict[str, str], *, head_only: bool
) -> bytes:
    """The reply's bytes as h11 frames them on ``conn`` (which has read the request)."""
    data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    fields = [
        ("content-type", "application/json"),
        ("content-length", str(len(data))),
        ("connection", "close"),
        *headers.items(),
    ]
    events: list[h11.Response | h11.Data | h11.EndOfMessage] = [
        h11.Response(status_code=status, reason=HTTPStatus(status).phrase, headers=fields)
    ]
    if not head_only:  # a reply to HEAD has no body (h11 refuses one)
        events.append(h11.Data(data=data))
    events.append(h11.EndOfMessage())
    return b"".join(conn.send(event) or b"" for event in events)


class _GatedTCPServer(TCPServer):
    """Hypercorn's connection handler, behind the config's gate when it has one, and
    releasing a closed peer's descriptor at once."""

    async def _read_data(self) -> None:
        await super()._read_data()
        # The peer has closed (or the stream has): Hypercorn would leave the keep-alive timer
        # running, and its task group, hence the socket, waits for it (--http-idle-timeout-s
        # of a dead connection's descriptor). A request still running ends by its disconnect.
        await self.idle_task.stop()

    async def _close(self) -> None:
        # Hypercorn may close from the app's task (a reply that ends the connection, e.g. a
        # 408 to a stalled body), which Quart cancels as soon as the exchange is over: the
        # cancel lands between its send_eof and its aclose, and the socket stayed open for as
        # long as the peer kept it. Both calls return at once, so the shield cannot hang.
        with trio.CancelScope(shield=True):
            await super()._close()

    async def protocol_send(self, event: Any) -> None:
        if isinstance(event, RawData):
            # The common case of a streamed token: the socket has room, so one write sends
            # it. Hypercorn's path (lock, shielded scope, SocketStream.send_all, two
            # scheduler checkpoints) was half of the trio thread's work per streamed token
            # at 64 streams (benchmarks.ceiling --profile). What does not go out at once
            # takes that path, which waits for room and reports a broken peer.
            rest = self.write_now(event.data)
            if rest is not None:
                if rest:
                    await self.send_rest(rest)
                return
        await self._send_event(event)

    def write_now(self, data: bytes) -> bytes | None:
        """Write what the socket takes of ``data`` at once. None: nothing was written (it is
        empty, Hypercorn is sending, or the socket is full or failed); the caller sends it
        the usual way, which waits or finds out why. Else the rest, which must follow before
        anything else (``send_rest``); b"" when all went out."""
        if self.send_lock.locked():
            return None
        sent = _send_now(self.stream, data)
        return data[sent:] if sent else None

    async def send_rest(self, rest: bytes) -> None:
        """The rest of bytes ``write_now`` began, through Hypercorn's send (it waits for
        room, reports a gone peer), shielded as its own sends are: whatever is cancelled
        meanwhile, a cut chunk would corrupt the stream."""
        with trio.CancelScope(shield=True):
            await self._send_event(RawData(data=rest))

    async def _send_event(self, event: Any) -> None:
        try:
            await super().protocol_send(event)
        except trio.BusyResourceError:
            # Hypercorn's _close sends its EOF outside the send lock, so a reply racing the
            # close (its own 400 for a body cut short by the peer's EOF, or the app's reply)
            # finds the stream in use. The peer is going: treat it as a broken stream, as
            # Hypercorn does, instead of raising out of the connection (found by
            # benchmarks/hostile.py: a GET with a Content-Length it never sends, then EOF).
            await self.protocol.handle(Closed())

    async def run(self) -> None:
        _CONNECTION.set(self)  # inherited by the tasks serving its requests (chunk_writer)
        try:
            gate: ConnectionGate | None = getattr(self.config, _GATE_ATTR, None)
            if gate is None:
                await super().run()
                return
            await gate.serve(self.stream, super().run)  # type: ignore[arg-type]
        except Exception:
            # trio.serve_listeners lets a handler's exception end the whole server: one
            # connection's failure must cost that connection only.
            log.exception("HTTP connection from %s failed; closed", _peer(self.stream))
            with trio.CancelScope(shield=True):
                await self.stream.aclose()


_CONNECTION: ContextVar[_GatedTCPServer | None] = ContextVar("hydra_http_connection", default=None)


class ChunkWriter:
    """Writes a streamed response body's chunks straight to its socket, framed as h11 frames
    them (HTTP/1.1 chunked): a token's text then costs one write instead of a task switch to
    the body's reader and Quart's, Hypercorn's and h11's send path (together half of the trio
    thread's Python per streamed token at 64 streams, benchmarks.ceiling --profile-gil).

    Only for a body in progress (its head sent) with nothing of it waiting to be sent: the
    caller keeps the order (generation.py writes only while the body's reader waits with
    nothing queued, so everything it sent has gone out)."""

    __slots__ = ("_conn",)

    def __init__(self, conn: _GatedTCPServer) -> None:
        self._conn = conn

    def send_now(self, data: bytes) -> bytes | None:
        """Write ``data`` as one chunk, as much as the socket takes at once (the connection's
        ``write_now``: None when nothing was written, else the rest of the chunk for
        ``send_rest``). Empty data writes nothing: its chunk would end the body."""
        return self._conn.write_now(chunk(data)) if data else None

    async def send_rest(self, rest: bytes) -> None:
        """The rest of a chunk ``send_now`` began (the connection's ``send_rest``)."""
        await self._conn.send_rest(rest)


def chunk(data: bytes) -> bytes:
    """``data`` as one HTTP/1.1 chunk, the bytes h11's ``send(Data(data))`` gives for a chunked
    body (a test holds the two equal). Not h11 itself on this path: its state machine costs
    ~2.7 us more per streamed token (frame and write, 1.4 against 4.1 us here), a twentieth of
    the trio thread's whole cost per token at 64 streams."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def close_connection_after(nursery: trio.Nursery, seconds: float, what: str) -> None:
    """Close the current request's connection if ``nursery`` (the request's: it ends when
    the response is sent or the client leaves) still runs after ``seconds``.

    A response deadline cannot be a cancel: Hypercorn shields its socket writes, so a send
    waiting on a client that stopped reading outlives any cancel scope. Closing the stream
    ends it (the send fails, Hypercorn sees the connection closed), and the response body
    is closed, releasing what it held."""
    conn = _CONNECTION.get()
    if conn is None:
        return

    async def watchdog() -> None:
        await trio.sleep(seconds)
        log.info("%s to %s not read within %.1f s: connection closed", what, _peer(conn.stream), seconds)
        await trio.aclose_forcefully(conn.stream)

    nursery.start_soon(watchdog)


def chunk_writer() -> ChunkWriter | None:
    """The current request's ``ChunkWriter`` once its response head is sent, when the body
    is HTTP/1.1 chunked on plain TCP (h11 chunks a body of unknown length to an HTTP/1.1
    peer); None for HTTP/1.0 (no framing), HTTP/2 and TLS, which keep Hypercorn's path."""
    conn = _CONNECTION.get()
    if conn is None or not isinstance(conn.stream, trio.SocketStream):
        return None
    proto = getattr(conn.protocol, "protocol", None)
    if not isinstance(proto, H11Protocol):
        return None
    h11_conn = proto.connection
    if h11_conn.our_state is not h11.SEND_BODY or h11_conn.their_http_version != b"1.1":
        return None
    return ChunkWriter(conn)


def _send_now(stream: Any, data: bytes) -> int:
    """Bytes of ``data`` written at once to a plain TCP stream without waiting: 0 when the
    socket is full, or fails (the caller's wait then finds out why), or for a TLS stream."""
    if not data or not isinstance(stream, trio.SocketStream) or stream.socket.did_shutdown_SHUT_WR:
        return 0
    try:
        return os.write(stream.socket.fileno(), data)
    except OSError:
        return 0


def _peer(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except (OSError, ValueError, AttributeError):
        return "?"
    return f"{host}:{port}"


# ---- the seam: Hypercorn's private parts this module relies on --------------------------------
# Hypercorn has no public way to wrap its trio connection handler, so the worker's TCPServer is
# replaced (install) and ``_GatedTCPServer`` overrides and reads private members. pyproject.toml
# pins the versions this was written against (HYPERCORN_TESTED); install() checks every
# member before the server starts, so another version fails at once, by name, instead of
# serving with a gate or a fast path that silently does nothing.


HYPERCORN_TESTED = "hypercorn>=0.18,<0.19"


class HypercornSeamError(RuntimeError):
    """The installed Hypercorn lacks a private member ``_GatedTCPServer`` relies on."""


def _hypercorn_version() -> str:
    try:
        return importlib.metadata.version("hypercorn")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _seam_missing() -> list[str]:
    """The private members of Hypercorn's trio worker this module relies on that are missing
    or of another kind than expected (empty: all there)."""
    missing: list[str] = []

    def need(ok: Any, what: str) -> None:
        if not ok:
            missing.append(what)

    serve = getattr(hypercorn.trio.run, "worker_serve", None)
    need(
        isinstance(getattr(hypercorn.trio.run, "TCPServer", None), type)
        and serve is not None
        and "TCPServer" in serve.__code__.co_names,
        "hypercorn.trio.run.TCPServer (a class that worker_serve looks up when it serves)",
    )
    for name in ("run", "protocol_send", "_read_data", "_close"):  # overridden, calling super()
        need(inspect.iscoroutinefunction(getattr(TCPServer, name, None)), f"TCPServer.{name} (a coroutine function)")
    try:  # members set per connection: look at a connection that was never started
        probe = TCPServer(None, Config(), WorkerContext(None), {}, None)  # type: ignore[arg-type]
    except TypeError as exc:
        missing.append(f"TCPServer(app, config, context, state, stream) ({exc})")
        return missing
    need(isinstance(getattr(probe, "send_lock", None), trio.Lock), "TCPServer.send_lock (a trio.Lock)")
    stop = getattr(getattr(probe, "idle_task", None), "stop", None)
    need(inspect.iscoroutinefunction(stop), "TCPServer.idle_task.stop (a coroutine function)")
    for name in ("stream", "config"):
        need(hasattr(probe, name), f"TCPServer.{name}")
    try:  # what chunk_writer reads: the HTTP/1.1 protocol behind the wrapper, and its h11 state
        wrapper = ProtocolWrapper(
            None, Config(), WorkerContext(None), None, {}, False, None, None, probe.protocol_send, "http/1.1"  # type: ignore[arg-type]
        )
    except TypeError as exc:
        missing.append("ProtocolWrapper(app, config, context, task_group, state, ssl, client, server, send, "
                       f"alpn_protocol) ({exc})")
        return missing
    proto = getattr(wrapper, "protocol", None)
    need(isinstance(proto, H11Protocol), "ProtocolWrapper.protocol (an H11Protocol for http/1.1)")
    need(isinstance(getattr(proto, "connection", None), h11.Connection), "H11Protocol.connection (an h11.Connection)")
    return missing


def install() -> None:
    """Make ``_GatedTCPServer`` the handler of Hypercorn's trio worker, in this process (the
    one place that patches Hypercorn; idempotent). Raises HypercornSeamError naming what is
    missing when the installed Hypercorn is not one this was written against."""
    if getattr(hypercorn.trio.run, "TCPServer", None) is _GatedTCPServer:
        return
    missing = _seam_missing()
    if missing:
        raise HypercornSeamError(
            f"Hypercorn {_hypercorn_version()} is not one hydra-trio's HTTP connection handler "
            f"works with (tested: {HYPERCORN_TESTED}): missing or changed: {'; '.join(missing)}"
        )
    hypercorn.trio.run.TCPServer = _GatedTCPServer  # type: ignore[misc]  # the seam: see the module doc


def attach(config: Config, state: AppState, health: HealthReply, file_limit: int) -> ConnectionGate:
    """Put a gate on ``config`` (served by ``_GatedTCPServer`` once ``install`` has run);
    logs the bound."""
    gate = ConnectionGate(
        connection_bound(state.settings, file_limit), health, state.metrics.registry
    )
    setattr(config, _GATE_ATTR, gate)
    log.info(
        "HTTP serves up to %d connections at once (--max-http-connections; open-file limit %d); "
        "past that, %d more at a time get one answer each (/health, else 503)",
        gate.bound,
        file_limit,
        OVERFLOW_RESERVE,
    )
    return gate
