"""The payload byte budget (--max-inflight-bytes) shared by every front end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import trio

from ..wire.errors import ErrorCode, ProtocolError, Status
from .grants import FifoGrants


class ByteBudget:
    """Bounds the payload bytes held by all requests together (RPC payloads, HTTP state
    uploads, KV pulls): a request whose payload does not fit waits (its sender is held back
    by TCP) until others release theirs. Waiters are served in arrival order: a stream of
    small payloads cannot starve a large one."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self.discarded = 0  # bytes of refused payloads read and thrown away (drain_charged)
        self._line: FifoGrants[int, int] = FifoGrants(self._take)

    @property
    def waiting(self) -> int:
        """Requests waiting for room."""
        return len(self._line)

    def _take(self, n: int) -> int | None:
        # Zero bytes always fit; a payload larger than the whole budget runs alone.
        if n == 0 or self.used + n <= self.total or self.used == 0:
            self.used += n
            return n
        return None

    async def acquire(self, n: int) -> None:
        """Take ``n`` bytes once they fit and every earlier waiter has been served. No
        deadline of its own: the caller's cancel scope bounds the wait, and a cancelled wait
        takes nothing."""
        await self._line.acquire(n)

    async def take(self, n: int, *, within_s: float, what: str) -> None:
        """The one payload-budget wait of every front end: take ``n`` bytes within
        ``within_s`` seconds (in arrival order), or refuse with the one "busy, retry" error
        (BUSY, TIMEOUT; HTTP 503 with Retry-After). The caller releases them."""
        with trio.move_on_after(within_s) as wait:
            await self.acquire(n)
        if wait.cancelled_caught:
            raise ProtocolError(
                ErrorCode.TIMEOUT,
                f"engine busy: no room in --max-inflight-bytes for {what} of {n} bytes within {within_s:g} s",
                status=Status.BUSY,
            )

    @asynccontextmanager
    async def held(self, n: int, *, within_s: float, what: str) -> AsyncIterator[None]:
        """``take`` for the length of a block, released when it ends."""
        await self.take(n, within_s=within_s, what=what)
        try:
            yield
        finally:
            self.release(n)

    @contextmanager
    def drain_charged(self, scratch: int) -> Iterator[None]:
        """A refused payload being read and discarded: the one scratch buffer it passes
        through is charged for as long as the drain runs, without waiting in line (the
        refusal's reply must not wait behind the uploads the refusal was about; each
        connection drains one payload at a time, so the overdraft is at most one scratch
        buffer per connection). The bytes themselves are never held."""
        self.used += scratch
        try:
            yield
        finally:
            self.release(scratch)

    def release(self, n: int) -> None:
        self.used -= n
        self._line.serve()
