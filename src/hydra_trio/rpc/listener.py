"""RPC listener and connection loop: the transport rules of spec §1.

Every request gets exactly one well-formed response or the connection closes; a refused
request's payload is drained (up to the drain limit) so the stream never desynchronises.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import trio

from ..concurrency import ByteBudget, raise_single
from ..config import Settings, is_loopback
from ..transport import PeerClosed
from ..wire.errors import BadMagic, ErrorCode, ProtocolError, Status
from ..wire.protocol import REQUEST_HEADER, encode_response, parse_request_header
from . import peer
from .connection import Connection
from .ops import OpContext, OpSpec, OpTable, Reply

if TYPE_CHECKING:
    from ..serving import AppState

log = logging.getLogger(__name__)

# accept() errors that mean "out of a resource, try again soon" (as in trio.serve_listeners)
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


async def open_rpc_listeners(settings: Settings) -> list[trio.SocketListener]:
    """Bind the RPC port (before the model loads, so a port in use is said at once)."""
    try:
        # The kernel queues at most max_connections more peers until there is a place.
        return await trio.open_tcp_listeners(settings.rpc_port, host=settings.host, backlog=settings.max_connections)
    except OSError as exc:
        raise OSError(exc.errno, f"RPC {settings.host}:{settings.rpc_port}: {exc.strerror}") from None


async def serve_rpc(
    state: AppState,
    listeners: list[trio.SocketListener],
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    settings = state.settings
    port = listeners[0].socket.getsockname()[1]
    # More connections than the bound wait for a place: a limiter, not a crash.
    places = trio.Semaphore(settings.max_connections)
    ops = OpTable(state)
    budget = state.payload_budget  # shared with the HTTP state uploads
    log.info("RPC listening on %s:%d (at most %d connections)", settings.host, port, settings.max_connections)
    serve = partial(_serve_connection, state, ops, places, budget)
    admit = _admission(state)
    async with trio.open_nursery() as nursery:  # owns the accept loops and every connection
        for listener in listeners:
            nursery.start_soon(_accept_loop, listener, places, admit, serve, nursery)
        task_status.started(port)


def _admission(state: AppState) -> Callable[[trio.SocketStream], bool]:
    """--rpc-allow: whether a just-accepted peer may be served (nothing read or written yet)."""
    settings = state.settings
    nets = settings.rpc_networks()
    if nets is None:
        if not is_loopback(settings.host):
            log.warning(
                "RPC binds %s without --rpc-allow: any peer that reaches the port can read and "
                "overwrite slots (RPC has no per-request authentication)",
                settings.host,
            )
        return lambda _stream: True
    log.info("RPC peers allowed from %s", ", ".join(map(str, nets)))

    def admit(stream: trio.SocketStream) -> bool:
        try:
            host = stream.socket.getpeername()[0]
            ip = ipaddress.ip_address(host.split("%", 1)[0])  # drop an IPv6 zone
        except (OSError, ValueError):
            ip = None
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # a dual-stack socket reports IPv4 peers as ::ffff:a.b.c.d
        if ip is not None and any(ip in net for net in nets):
            return True
        state.metrics.rpc_peers_refused.inc()
        log.info("rpc %s: peer not in --rpc-allow; closed", ip)
        return False

    return admit


async def _accept_loop(
    listener: trio.SocketListener,
    places: trio.Semaphore,
    admit: Callable[[trio.SocketStream], bool],
    serve: Callable[[trio.SocketStream], Awaitable[None]],
    nursery: trio.Nursery,
) -> None:
    """Take a connection place first, then accept: the engine never holds a socket it cannot
    serve (peers beyond the bound wait in the kernel's listen backlog, not in this process)."""
    async with listener:
        while True:
            await places.acquire()
            try:
                stream = await listener.accept()
            except OSError as exc:
                places.release()
                if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                    raise
                log.error("RPC accept failed (%s); retrying in 100 ms", exc)
                await trio.sleep(0.1)
                continue
            except BaseException:
                places.release()
                raise
            if not admit(stream):
                places.release()
                await trio.aclose_forcefully(stream)
                continue
            nursery.start_soon(serve, stream)  # releases the place when it ends


async def _serve_connection(
    state: AppState, ops: OpTable, places: trio.Semaphore, budget: ByteBudget, stream: trio.SocketStream
) -> None:
    with _releasing(places):  # the place the accept loop took for this connection
        conn = Connection(stream, state.settings.idle_timeout_s)
        state.metrics.rpc_connections.inc()
        try:
            await _connection_loop(state, ops, conn, budget)
        except (PeerClosed, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.debug("rpc %s: connection ended: %s", conn.peer, exc)
        except trio.TooSlowError:
            log.info("rpc %s: peer stalled for %g s mid-exchange; closing", conn.peer, conn.idle_timeout_s)
        except Exception:
            log.exception("rpc %s: connection failed", conn.peer)
        finally:
            state.metrics.rpc_connections.dec()
            with trio.CancelScope(shield=True):
                await stream.aclose()


@contextmanager
def _releasing(places: trio.Semaphore) -> Iterator[None]:
    try:
        yield
    finally:
        places.release()


async def _read_request_header(conn: Connection) -> bytearray | None:
    """The next header, or None when the peer closes (or idles out) between requests."""
    buf = bytearray(REQUEST_HEADER.size)
    view = memoryview(buf)
    with trio.move_on_after(conn.idle_timeout_s):
        try:
            k = await conn.sock.recv_into(view, len(buf))
        except OSError:
            return None
        if k == 0:
            return None
        if k < len(buf):
            await conn.read_into(view[k:])
        return buf
    log.debug("rpc %s: idle for %.0f s; closing", conn.peer, conn.idle_timeout_s)
    return None


async def _connection_loop(state: AppState, ops: OpTable, conn: Connection, budget: ByteBudget) -> None:
    settings = state.settings
    while True:
        raw = await _read_request_header(conn)
        if raw is None:
            return
        try:
            head = parse_request_header(raw)
        except BadMagic as exc:
            log.warning("rpc %s: %s; closing without reply", conn.peer, exc)
            return
        key = bytes(await conn.read_exact(head.key_len))
        trace = bytes(await conn.read_exact(head.trace_len)).decode("utf-8", "replace")[:200]
        rlog = _TraceLog(log, trace, conn.peer)
        op_name = ops.name(head.op)
        ctx = OpContext(conn=conn, key=key, trace=trace, log=rlog, payload_len=head.payload_len)
        spec: OpSpec | None = None
        try:
            if head.flags != 0:
                raise ProtocolError(
                    ErrorCode.BAD_FRAME, f"unsupported flags 0x{head.flags:02x}", status=Status.BAD_REQUEST
                )
            spec = ops.get(head.op)
            cap = spec.cap(settings)
            if head.payload_len > cap:
                raise ProtocolError(ErrorCode.TOO_LARGE, f"{op_name} payload of {head.payload_len} bytes exceeds the "
                                    f"cap of {cap}")
            spec.precheck(ctx)
            await budget.take(head.payload_len, within_s=settings.idle_timeout_s, what=f"a {op_name} payload")
        except ProtocolError as err:
            rlog.info("%s refused before payload: %s", op_name, err.message)
            state.metrics.rpc_requests.labels(op_name, err.status.name).inc()
            limit = settings.drain_limit_bytes
            if spec is not None and spec.drain_to_cap:
                limit = max(limit, spec.cap(settings))
            if head.payload_len <= limit and await _discard(conn, head.payload_len, settings, budget):
                await _send_reply(conn, Reply.error(err))
                continue
            await _send_reply(conn, Reply.error(err))
            if head.payload_len > limit:
                rlog.info("payload of %d bytes is over the drain limit of %d: closing", head.payload_len, limit)
                await _linger(conn, min(head.payload_len, LINGER_FACTOR * limit), settings, budget)
            return
        try:
            # The one buffer it lives in.
            payload = await (spec.receive(ctx) if spec.receive else conn.read_payload(head.payload_len))
        except BaseException:
            budget.release(head.payload_len)
            raise
        state.metrics.rpc_bytes_in.inc(head.payload_len)
        keep_open = await _answer(state, spec, ctx, payload, partial(budget.release, head.payload_len))
        del payload  # ops keep no view of it past their reply
        if not keep_open:
            return


_SCRATCH = 1 << 20  # the one buffer a refused payload passes through
# After the refusal of a payload too large to drain: read on for at most this many times the
# drain bound, while the peer goes on sending, and stop at its first pause this long (it has
# its answer: a peer that stops sending is not writing a request).
LINGER_FACTOR = 4
LINGER_SILENCE_S = 1.0


async def _linger(conn: Connection, n: int, settings: Settings, budget: ByteBudget) -> None:
    """After the refusal of a payload over the drain bound was written: read and throw away up
    to ``n`` more of its bytes, then the caller closes. A client that writes its whole request
    before it reads (the coordinator's, every KV client) is blocked in its send; a close with
    its bytes unread would answer it with a reset, which can discard the refusal unread, and
    it would upload again. Bounded as a drain is (the upload floor), by LINGER_SILENCE_S of
    silence and by --idle-timeout-s in all; the connection closes whatever happens."""
    silence = min(LINGER_SILENCE_S, conn.idle_timeout_s)
    with trio.move_on_after(conn.idle_timeout_s):
        try:
            await _discard(conn, n, settings, budget, silence_s=silence, what="refused payload after its reply")
        except PeerClosed:  # it stopped writing, or read its reply and left: nothing to wait for
            pass


async def _discard(
    conn: Connection,
    n: int,
    settings: Settings,
    budget: ByteBudget,
    *,
    silence_s: float | None = None,
    what: str = "refused payload",
) -> bool:
    """Read and throw away a refused request's ``n`` payload bytes, so that a client that
    writes its whole request before reading (every KV client does) gets the refusal. The
    bytes pass through one small scratch buffer charged to the payload budget, never held.
    The upload rules apply: no byte for ``silence_s`` (default --idle-timeout-s), or less than
    --min-upload-bytes-per-s on average after --upload-grace-s, and the drain stops (False:
    the caller replies and closes), so a refusal cannot become a way to hold a connection.
    The peer leaving mid-drain raises PeerClosed, as any read."""
    if n == 0:
        return True
    scratch = memoryview(bytearray(min(n, _SCRATCH)))
    rate = settings.min_upload_bytes_per_s
    silence = conn.idle_timeout_s if silence_s is None else silence_s
    start = last = trio.current_time()
    got = 0
    with budget.drain_charged(len(scratch)):
        while got < n:
            deadline = last + silence
            if rate:
                deadline = min(deadline, start + settings.upload_grace_s + got / rate)
            with trio.move_on_at(deadline):
                try:
                    k = await conn.sock.recv_into(scratch, min(n - got, len(scratch)))
                except OSError as exc:
                    raise PeerClosed(f"peer left mid-drain: {exc}", got=got, n=n, cause=exc) from None
                if k == 0:
                    raise PeerClosed("peer closed mid-drain", got=got, n=n)
                got += k
                budget.discarded += k
                last = trio.current_time()
                continue
            log.info(
                "rpc %s: %s stopped or too slow (%d of %d bytes in %.1f s); closing",
                conn.peer, what, got, n, trio.current_time() - start,
            )
            return False
    return True


async def _answer(
    state: AppState, spec: OpSpec, ctx: OpContext, payload: np.ndarray, release_payload: Callable[[], None]
) -> bool:
    """Run the op and write its one reply; False when the peer hung up first (close).

    For ops that stop when the caller hangs up (``spec.hang_up``, rpc/peer.py), the hang-up
    cancels everything from the op's start until its reply is written: a reset for both
    PREFILL and DECODE, EOF too for PREFILL. A DECODE peer that sent EOF may only have
    half-closed (it still reads): its op finishes and the reply is written, then
    ``peer.reset_after_reply`` tells a closed peer (it answers with a reset) from a reading
    one. What the op started (a DECODE request) is committed once the reply is out and was
    not answered with a reset, and abandoned otherwise: nobody learned its id.
    """
    try:
        return await _answer_or_hang_up(state, spec, ctx, payload, release_payload)
    except BaseExceptionGroup as group:  # the watcher's nursery wraps what the body raised
        raise_single(group)


async def _answer_or_hang_up(
    state: AppState, spec: OpSpec, ctx: OpContext, payload: np.ndarray, release_payload: Callable[[], None]
) -> bool:
    sock = ctx.conn.sock
    released = False

    def release_once() -> None:
        nonlocal released
        if not released:
            released = True
            release_payload()

    ctx.release_payload = release_once
    watch = trio.CancelScope()  # the watcher's own: it watches the op, not the reply
    async with trio.open_nursery() as hangup:
        if spec.hang_up is not peer.HangUp.NEVER:
            hangup.start_soon(_cancel_on_hang_up, sock, spec.hang_up, hangup.cancel_scope, watch)
        try:
            reply = await _run_op(spec, ctx, memoryview(payload))
        finally:
            release_once()
        # From here a failed send, or reset_after_reply, tells whether the reply was taken.
        watch.cancel()
        state.metrics.rpc_requests.labels(spec.name, reply.status.name).inc()
        try:
            await _deliver(state, spec, ctx, reply)
        finally:
            state.payload_budget.release(reply.held)  # a snapshot's charge: sent, or never will be
        hangup.cancel_scope.cancel()
        return True
    how = "closed or reset" if spec.hang_up is peer.HangUp.EOF else "reset"
    ctx.log.info("%s: peer %s the connection before the reply; request cancelled", spec.name, how)
    return False


async def _deliver(state: AppState, spec: OpSpec, ctx: OpContext, reply: Reply) -> None:
    """Write the reply; commit what it started once the peer took it, abandon it otherwise."""
    sock = ctx.conn.sock
    try:
        if spec.hang_up is not peer.HangUp.NEVER and peer.was_reset(sock):
            # The reset came in the batch that ended the op; the watcher has not run yet.
            raise PeerClosed("peer reset the connection before the reply")
        await _send_reply(ctx.conn, reply)
        if reply.started is not None and peer.saw_eof(sock) and await peer.reset_after_reply(sock):
            # Its EOF was a close, not a half-close: the reply reached a closed socket.
            raise PeerClosed("peer had closed before the reply: it answered with a reset")
    except BaseException:
        if reply.started is not None:
            ctx.log.info("%s: reply not written, or not read; cancelling what it started", spec.name)
            with trio.CancelScope(shield=True):
                await reply.started.abandon()
        raise
    if reply.started is not None:
        reply.started.commit()
    state.metrics.rpc_bytes_out.inc(reply.payload_len)


async def _cancel_on_hang_up(
    sock: trio.socket.SocketType, hang_up: peer.HangUp, scope: trio.CancelScope, watch: trio.CancelScope
) -> None:
    with watch:
        await peer.wait_hang_up(sock, hang_up)
        scope.cancel()


async def _run_op(spec: OpSpec, ctx: OpContext, payload: memoryview) -> Reply:
    """The op's reply; a refusal or failure becomes an error reply."""
    try:
        return await spec.run(ctx, payload)
    except ProtocolError as err:
        ctx.log.info(
            "%s failed: %s %s", spec.name, err.code, err.message,
            extra=ctx.request_line(spec.name, "failed", error=f"{err.code}: {err.message}"),
        )
        return Reply.error(err)
    except Exception as exc:
        ctx.log.exception("%s: internal error", spec.name)
        return Reply.error(ProtocolError(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"))


async def _send_reply(conn: Connection, reply: Reply) -> None:
    head = encode_response(reply.status, reply.meta, reply.payload_len)
    await conn.send([head, *reply.payload], chunk=reply.send_chunk)


class _TraceLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Puts the request's trace_id (and peer) on every log line of that request."""

    def __init__(self, logger: logging.Logger, trace: str, peer: str) -> None:
        super().__init__(logger, {"trace_id": trace})
        self.prefix = f"rpc {peer} trace={trace or '-'}: "

    def process(self, msg: object, kwargs: dict) -> tuple[str, dict]:  # type: ignore[override]
        kwargs.setdefault("extra", {}).update(self.extra or {})
        return self.prefix + str(msg), kwargs
