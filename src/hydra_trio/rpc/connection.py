"""Exact-length reads into preallocated buffers on a trio socket (transport/receive.py reads, peer.py
watches the peer)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import trio

from ..transport import draining_recv_into, draining_send, payload_buffer, recv_exactly, recv_exactly_hashing
from ..wire.hashing import Buffer


class Connection:
    """One RPC connection. Reads go straight into caller buffers with recv_into, so a
    multi-GB payload is received into one preallocated buffer without per-chunk copies."""

    def __init__(self, stream: trio.SocketStream, idle_timeout_s: float) -> None:
        self.stream = stream
        self.sock = stream.socket
        self.peer = _peer_name(self.sock)
        self.idle_timeout_s = idle_timeout_s
        self._recv_into = draining_recv_into(self.sock)  # payloads of MBs: no trio yield per read

    async def read_into(self, view: memoryview, on_progress: Callable[[int], None] | None = None) -> None:
        """Fill ``view`` (reading.recv_exactly): PeerClosed when the peer leaves mid-read,
        trio.TooSlowError when it is silent for idle_timeout_s."""
        await recv_exactly(self._recv_into, view, idle_timeout_s=self.idle_timeout_s, on_progress=on_progress)

    async def read_payload_hashing(self, n: int, span_of: SpanOf) -> tuple[np.ndarray, int | None]:
        """Read ``n`` bytes like ``read_payload``, and hash one span of them as it arrives.

        ``span_of(head)`` looks at the bytes received so far: it answers how many leading
        bytes it needs (an int), the span to hash (``(start, length)``), or None (nothing
        to hash). The span is hashed (XXH3-64) as its bytes land, each read's after it
        (transport.recv_exactly_hashing), so the digest is ready when the last byte is.
        Returns (buffer, digest or None).
        """
        buf = payload_buffer(n)
        view = memoryview(buf)
        got = 0
        while isinstance(want := span_of(view[:got]), int):
            if not got < want <= n:
                want = None
                break
            await self.read_into(view[got:want])
            got = want
        if want is None:
            await self.read_into(view[got:])
            return buf, None
        digest = await recv_exactly_hashing(
            self._recv_into, view, want, got=got, idle_timeout_s=self.idle_timeout_s
        )
        return buf, digest

    async def read_payload(self, n: int) -> np.ndarray:
        """Read ``n`` bytes into one new buffer (see payload_buffer)."""
        buf = payload_buffer(n)
        if n:
            await self.read_into(memoryview(buf))
        return buf

    async def read_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        if n:
            await self.read_into(memoryview(buf))
        return buf

    async def send(self, parts: Sequence[Buffer], chunk: int | None = None) -> None:
        """Send every part (transport.draining_send: no trio yield per write). A peer that
        accepts no byte for idle_timeout_s raises trio.TooSlowError: the deadline restarts
        at each bit of progress, so a large reply to a slow reader may take long, a reader
        that stopped may not hold the connection. ``chunk``: most bytes per write
        (state_chunk_size)."""
        await draining_send(self.sock, parts, idle_timeout_s=self.idle_timeout_s, chunk=chunk)

    async def aclose(self) -> None:
        await self.stream.aclose()


def _peer_name(sock: trio.socket.SocketType) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


SpanOf = Callable[[memoryview], "int | tuple[int, int] | None"]
