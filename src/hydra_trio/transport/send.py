"""Sending a large reply to a peer: ``draining_send``, the send side of ``draining_recv_into``
(receive.py): non-blocking writes while the socket takes bytes, a wait only when its
buffer is full."""

from __future__ import annotations

import os
from collections.abc import Sequence

import trio

from ..wire.hashing import Buffer
from .receive import DRAIN_MAX


async def draining_send(
    sock: trio.socket.SocketType, parts: Sequence[Buffer], *, idle_timeout_s: float | None, chunk: int | None = None
) -> None:
    """Send every part, in order. Each write takes what the socket's buffer has room for
    (at most ``chunk`` bytes, the slot's ``state_chunk_size``, when given), with no trio
    checkpoint between writes that make progress: trio's ``send`` yields to the scheduler
    after every write, once per few hundred KB on loopback (a 148.5 MB KV_PULL reply made
    ~600 trips through the scheduler). It waits for room only when the buffer is full, each
    wait bounded by ``idle_timeout_s`` (trio.TooSlowError: a peer that takes no byte that
    long; None: by the caller's scope alone), and lets other tasks run every 8 MiB written. A broken connection raises
    trio.BrokenResourceError (what SocketStream.send_all raises). The descriptor is read
    again after every wait: a socket closed meanwhile gives EBADF, not another's bytes."""
    await trio.lowlevel.checkpoint_if_cancelled()
    since_yield = 0
    for part in parts:
        view = memoryview(part).cast("B") if len(part) else None
        if view is None:
            continue
        step = min(len(view) if chunk is None else max(1, chunk), DRAIN_MAX)
        off = 0
        while off < len(view):
            try:
                k = os.write(sock.fileno(), view[off : off + step])
            except BlockingIOError:
                if idle_timeout_s is None:
                    await trio.lowlevel.wait_writable(sock)
                else:
                    with trio.fail_after(idle_timeout_s):
                        await trio.lowlevel.wait_writable(sock)
                since_yield = 0
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(f"send failed after {off}/{len(view)} bytes: {exc}") from exc
            off += k
            since_yield += k
            if since_yield >= DRAIN_MAX:
                await trio.lowlevel.checkpoint()
                since_yield = 0
    await trio.lowlevel.cancel_shielded_checkpoint()
