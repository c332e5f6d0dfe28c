"""Receiving from a peer, for every side (the engine's RPC connections, the RPC clients and
their blocking twin, the hand-off's KV_PULL, HTTP state uploads): the buffer a payload is
read into, the one exact-length read (and its twin that hashes a span as it arrives), and
the one RPC reply reader.

The reads are written once as coroutines over a ``recv_into(view, nbytes) -> int`` callable:
a trio socket's, or a blocking socket's wrapped in a coroutine that never suspends, which
``run_blocking`` runs to its end without an event loop.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import numpy as np
import trio
import xxhash

from ..wire.errors import ErrorCode, ProtocolError
from ..wire.jsontext import parse_json_object
from ..wire.protocol import RESPONSE_HEADER, ResponseHeader, parse_response_header

T = TypeVar("T")
RecvInto = Callable[[memoryview, int], Awaitable[int]]


class PeerClosed(Exception):
    """The peer closed the connection (or it broke) in the middle of a read. ``cause``: the
    socket's error, when it broke (None: an orderly close)."""

    def __init__(self, message: str, *, got: int = 0, n: int = 0, cause: OSError | None = None) -> None:
        super().__init__(message)
        self.got, self.n = got, n  # bytes of the read received, and wanted
        self.cause = cause


async def recv_exactly(
    recv_into: RecvInto,
    view: memoryview,
    *,
    idle_timeout_s: float | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> None:
    """Fill ``view``, or raise PeerClosed. With ``idle_timeout_s``, a peer silent that long
    mid-read raises trio.TooSlowError (a large payload may take long; a stalled one may not).
    ``on_progress(got)`` is called after every receive with the bytes of ``view`` filled so far."""
    got = 0
    n = len(view)
    while got < n:
        try:
            if idle_timeout_s is None:
                k = await recv_into(view[got:], n - got)
            else:
                with trio.fail_after(idle_timeout_s):
                    k = await recv_into(view[got:], n - got)
        except OSError as exc:
            raise PeerClosed(f"connection error after {got}/{n} bytes: {exc}", got=got, n=n, cause=exc) from None
        if k == 0:
            raise PeerClosed(f"peer closed after {got}/{n} bytes", got=got, n=n)
        got += k
        if on_progress is not None:
            on_progress(got)


# Most bytes a draining receive takes, or a draining send writes (send.py), before other tasks run.
DRAIN_MAX = 8 << 20


def draining_recv_into(sock: trio.socket.SocketType) -> RecvInto:
    """``sock.recv_into`` for large reads: each call takes what the socket holds, up to
    ``nbytes`` (at most 8 MiB), in non-blocking reads without a trio checkpoint between
    them, and waits for readability only when the socket is empty. trio's own
    ``recv_into`` yields to the scheduler after every read: 148.5 MB over loopback took
    135 ms that way against 99 ms for a blocking ``recv_into`` loop (benchmarks/
    handoff_parts.py). It checkpoints once per call, as trio's does, so a cancellation or
    the caller's ``fail_after`` still bounds it. The descriptor is read at each call, not
    kept: a closed socket's is -1 (EBADF, an OSError), never a number another socket reuses."""

    async def recv_into(view: memoryview, nbytes: int) -> int:
        await trio.lowlevel.checkpoint_if_cancelled()
        fd = sock.fileno()
        want = min(nbytes, len(view), DRAIN_MAX)
        got = 0
        while got < want:
            try:
                k = os.readv(fd, [view[got:want]])
            except BlockingIOError:
                if got:
                    break
                await trio.lowlevel.wait_readable(sock)
                continue
            if k == 0:
                break
            got += k
        await trio.lowlevel.cancel_shielded_checkpoint()
        return got

    return recv_into


async def recv_exactly_hashing(
    recv_into: RecvInto,
    view: memoryview,
    span: tuple[int, int],
    *,
    got: int = 0,
    idle_timeout_s: float | None = None,
) -> int:
    """Fill ``view[got:]`` as ``recv_exactly`` does (its first ``got`` bytes are there
    already), and hash ``view[start : start + length]`` (``span``; XXH3-64) as its bytes
    arrive: each read's bytes right after it, on this thread, while they are still in the
    CPU's cache (a draining read takes at most 8 MiB: about 1 ms of XXH3), so the digest is
    ready when the last byte is. A hashing thread a few MB behind the receive did the same
    work with a thread hop per 8 MiB and a third busy thread beside the sender and the
    receive: on this 2-core VM the engines' 151 MB pull took 150 ms that way against 113 ms
    inline (benchmarks/handoff_engine_parts.py, load 4.5). Returns the digest."""
    start, length = span
    end = start + length
    hasher = xxhash.xxh3_64()
    hashed = max(start, min(got, end))  # the span's bytes hashed so far end here
    if hashed > start:
        hasher.update(view[start:hashed])

    def hash_arrived(k: int) -> None:
        nonlocal hashed
        upto = max(start, min(got + k, end))
        if upto > hashed:
            hasher.update(view[hashed:upto])
            hashed = upto

    await recv_exactly(recv_into, view[got:], idle_timeout_s=idle_timeout_s, on_progress=hash_arrived)
    return hasher.intdigest()  # type: ignore[no-any-return]


async def recv_bytes(recv_into: RecvInto, n: int) -> bytearray:
    buf = bytearray(n)
    if n:
        await recv_exactly(recv_into, memoryview(buf))
    return buf


async def read_reply_head(
    recv_into: RecvInto, *, max_meta_bytes: int | None = None
) -> tuple[ResponseHeader, dict[str, Any]]:
    """A reply's header and its meta (strict JSON, an object; ``{}`` when empty); the caller
    reads its ``payload_len`` bytes of payload as it sees fit. BAD_FRAME for a malformed
    header, TOO_LARGE for a meta over ``max_meta_bytes``, BAD_JSON for a bad meta."""
    head = parse_response_header(await recv_bytes(recv_into, RESPONSE_HEADER.size))
    if max_meta_bytes is not None and head.meta_len > max_meta_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"reply meta of {head.meta_len} bytes (at most {max_meta_bytes})")
    meta = parse_json_object(await recv_bytes(recv_into, head.meta_len), "reply meta") if head.meta_len else {}
    return head, meta


def run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine whose awaits never suspend (blocking calls inside ``async def``) to its
    end, without an event loop: how the blocking client reuses the readers above."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("run_blocking: the coroutine suspended; it needs an event loop")


_NO_HUGEPAGES_MIN = 4 << 20  # numpy madvises huge pages for arrays from this size on
_MMAP_MIN = 64 << 20  # above glibc malloc's largest mmap threshold: smaller buffers reuse heap pages


def payload_buffer(n: int) -> np.ndarray:
    """One buffer of ``n`` bytes for a payload to be received into.

    Below 4 MiB, uninitialised heap memory (``np.empty``): no zero-fill pass, and the
    receive writes every byte before anything reads it (a short read drops the buffer).
    From 4 MiB, ``np.empty`` would ask for transparent huge pages (numpy's madvise), and with
    the kernel's "madvise" defrag a page fault then stalls for compaction (DECODE acks of a
    151 MB blob varied 80-380 ms). So from there: a bytearray up to 64 MiB (zeroed, but malloc
    reuses already-mapped heap pages, which measured 2-3x faster than faulting in a fresh
    mapping at 1-17 MB), and above, an anonymous mapping that an earlier payload used and
    nothing holds any more (``_Mappings``), else a new one."""
    if n < _NO_HUGEPAGES_MIN:
        return np.empty(n, dtype=np.uint8)
    if n < _MMAP_MIN:
        return np.frombuffer(bytearray(n), dtype=np.uint8)
    return np.frombuffer(_MAPPINGS.take(n), dtype=np.uint8, count=n)


class _Mappings:
    """The large receive buffers, kept for the next payloads. A fresh page's first touch is
    what a large receive costs most on a VM: 148.5 MB into a new mapping took 0.9-2.2 s over
    loopback TCP against 0.2-0.8 s into one written before, and first-writing it alone
    0.6-3.9 s against 36-57 ms to copy into touched memory (this 2-core VM, loaded; the cost
    of a fresh page is the host's and varies from VM to VM). A mapping is handed out again
    only once nothing exports it (every array and view of the last payload is gone: the
    same-size ``resize`` that mmap refuses while buffers are exported), to a payload of at
    least half its size; at most ``KEEP`` are kept (the least recently used one is dropped
    first), so the memory held past the payloads is at most that many payloads' worth."""

    KEEP = 2

    def __init__(self) -> None:
        self._kept: list[mmap.mmap] = []  # most recently handed out last
        self._lock = threading.Lock()  # the blocking client receives on other threads

    def take(self, n: int) -> mmap.mmap:
        with self._lock:
            for m in self._kept:
                if n <= len(m) <= 2 * n and _unexported(m):
                    self._kept.remove(m)
                    self._kept.append(m)
                    return m
            m = mmap.mmap(-1, n)
            self._kept.append(m)
            if len(self._kept) > self.KEEP:
                free = next((k for k in self._kept if _unexported(k)), None)
                self._kept.remove(free if free is not None else self._kept[0])
            return m


def _unexported(m: mmap.mmap) -> bool:
    """Nothing holds a buffer of ``m`` (a same-size resize changes nothing; mmap refuses
    any resize while buffers are exported)."""
    try:
        m.resize(len(m))
    except (BufferError, OSError, ValueError, SystemError):  # exported, or no mremap here
        return False
    return True


_MAPPINGS = _Mappings()
