"""Exact-length reads into preallocated buffers on a trio socket (receive.py reads, peer.py
watches the peer)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import trio
import xxhash

from ..receive import payload_buffer, recv_exactly
from ..tasks import raise_single

Buffer = bytes | bytearray | memoryview


class Connection:
    """One RPC connection. Reads go straight into caller buffers with recv_into, so a
    multi-GB payload is received into one preallocated buffer without per-chunk copies."""

    def __init__(self, stream: trio.SocketStream, idle_timeout_s: float) -> None:
        self.stream = stream
        self.sock = stream.socket
        self.peer = _peer_name(self.sock)
        self.idle_timeout_s = idle_timeout_s

    async def read_into(self, view: memoryview, on_progress: Callable[[int], None] | None = None) -> None:
        """Fill ``view`` (reading.recv_exactly): PeerClosed when the peer leaves mid-read,
        trio.TooSlowError when it is silent for idle_timeout_s."""
        await recv_exactly(self.sock.recv_into, view, idle_timeout_s=self.idle_timeout_s, on_progress=on_progress)

    async def read_payload_hashing(self, n: int, span_of: SpanOf) -> tuple[np.ndarray, int | None]:
        """Read ``n`` bytes like ``read_payload``, and hash one span of them as it arrives.

        ``span_of(head)`` looks at the bytes received so far: it answers how many leading
        bytes it needs (an int), the span to hash (``(start, length)``), or None (nothing
        to hash). The span is hashed (XXH3-64) in a worker thread, a few MB behind the
        receive, so the digest is ready when the last byte is. Returns (buffer, digest or None).
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
        start, length = want
        hasher = xxhash.xxh3_64()
        received = _Received(got)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_hash_behind, view[start : start + length], start, hasher, received)
                await self.read_into(view[got:], lambda k: received.advance(got + k))
        except BaseExceptionGroup as group:  # the hashing task's nursery wraps what was raised
            raise_single(group)
        return buf, hasher.intdigest()

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
        """Send every part. A peer that accepts no byte for idle_timeout_s raises
        trio.TooSlowError: the deadline restarts at each bit of progress, so a large reply
        to a slow reader may take long, a reader that stopped may not hold the connection."""
        for part in parts:
            view = memoryview(part).cast("B") if len(part) else None
            if view is None:
                continue
            step = len(view) if chunk is None else chunk  # state_chunk_size: most bytes per send
            off = 0
            while off < len(view):
                try:
                    with trio.fail_after(self.idle_timeout_s):
                        off += await self.sock.send(view[off : off + step])
                except OSError as exc:  # what SocketStream.send_all raises: callers catch it
                    raise trio.BrokenResourceError(f"send failed after {off}/{len(view)} bytes: {exc}") from exc

    async def aclose(self) -> None:
        await self.stream.aclose()


def _peer_name(sock: trio.socket.SocketType) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"



SpanOf = Callable[[memoryview], "int | tuple[int, int] | None"]
_HASH_CHUNK = 8 << 20  # hashed per worker-thread hop: ~0.4 ms of XXH3, ~0.1 ms of hop


class _Received:
    """How many payload bytes have arrived; wakes the hashing task as they do."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._more = trio.Event()

    def advance(self, n: int) -> None:
        self.n = n
        self._more.set()
        self._more = trio.Event()

    async def wait_for(self, n: int) -> None:
        while self.n < n:
            await self._more.wait()


async def _hash_behind(span: memoryview, offset: int, hasher: Any, received: _Received) -> None:
    """Feed ``span`` (which starts at payload ``offset``) to ``hasher`` as its bytes arrive.
    xxhash releases the GIL, so the receive goes on while a chunk is hashed."""
    pos = 0
    while pos < len(span):
        end = min(len(span), pos + _HASH_CHUNK)
        await received.wait_for(offset + end)
        await trio.to_thread.run_sync(hasher.update, span[pos:end])
        pos = end
