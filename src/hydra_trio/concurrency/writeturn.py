"""Whose turn it is to write a streamed body: its reader, or a direct writer.

A streamed response body has a reader (the body's async generator, whose chunks go through
Quart and Hypercorn) and, once its head is out on a plain HTTP/1.1 connection, a way to
write a chunk straight to the socket (``http/plumbing/connections.py`` ``ChunkWriter``). The direct
way saves a task switch per token, but only while nothing the reader was given is still
waiting, or the chunks would leave out of order. ``WriterTurn`` is that rule, in one place,
for the two streams that use it: a chat or text completion (``http/generation/generation.py``: the
request's producer task writes) and a DECODE result stream (``decode/store.py``
``Subscription``: the task that changed the entry writes, per reader).

- The reader hands the turn over (``hand_over``) only when it has sent all it was given and
  nothing is queued, just before it waits.
- The direct writer keeps it while its chunks go out whole. A chunk the socket did not take
  at all, or took only in part, ends the turn: the first goes the reader's way, and the rest
  of the second waits in ``rest`` for the reader, which sends it before anything else.
- Anything queued for the reader, or a wake-up, gives the turn back (``take_back``).
- Every reader has its own turn (a DECODE stream's replaying and live readers do not share).

It imports nothing of HTTP (``decode/`` uses it too); the writer is any ``ChunkSink``.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Protocol


class ChunkSink(Protocol):
    """What a direct writer writes through (``http/plumbing/connections.py`` ``ChunkWriter``)."""

    def send_now(self, data: bytes) -> bytes | None:
        """Write ``data`` as one chunk, what the socket takes at once: None when nothing was
        written, else the rest of the chunk (b"" when all of it went out)."""
        ...

    async def send_rest(self, rest: bytes) -> None:
        """The rest of a chunk ``send_now`` began, waiting for room (never cut short)."""
        ...


class Wrote(Enum):
    """What ``WriterTurn.write`` did with a chunk."""

    ALL = "all"  # it went out whole: the direct writer keeps the turn
    PART = "part"  # it went out in part: the turn is the reader's, the rest first (``rest``)
    NOTHING = "nothing"  # not its turn, or the socket took none of it: send it the reader's way


class WriterTurn:
    """One stream's write turn (see the module doc). ``direct`` is read on every token, so
    it is a plain attribute; only this class and the reader's ``hand_over``/``take_back``
    set it."""

    __slots__ = ("_encode", "_writer", "direct", "rest")

    def __init__(self) -> None:
        self._writer: ChunkSink | None = None
        self._encode: Callable[[str], bytes] | None = None
        self.direct = False  # True: the direct writer's turn
        self.rest = b""  # of a chunk the direct writer began: the reader sends it first

    def attach(self, writer: ChunkSink, encode: Callable[[str], bytes]) -> None:
        """The reader, once the response head is out: text deltas may go out as
        ``encode(text)`` through ``writer`` in the direct writer's turns. A stream never
        attached (HTTP/1.0, HTTP/2, TLS, logprobs) never hands its turn over."""
        self._writer, self._encode = writer, encode

    def hand_over(self) -> None:
        """The reader, about to wait with all it was given sent and nothing queued."""
        self.direct = self._writer is not None

    def take_back(self) -> None:
        """The reader's turn: something is queued for it, or it is awake."""
        self.direct = False

    def write(self, text: str) -> Wrote:
        """The direct writer: ``text``'s event as one chunk, if it is its turn."""
        if not self.direct:
            return Wrote.NOTHING
        assert self._writer is not None and self._encode is not None  # direct implies attached
        left = self._writer.send_now(self._encode(text))
        if left is None:
            self.direct = False
            return Wrote.NOTHING
        if left:
            self.direct = False
            self.rest = left
            return Wrote.PART
        return Wrote.ALL

    async def send_rest(self) -> None:
        """The reader, before anything else it sends: the rest of a chunk the direct writer
        began, if there is one."""
        if self.rest:
            assert self._writer is not None
            rest, self.rest = self.rest, b""
            await self._writer.send_rest(rest)
