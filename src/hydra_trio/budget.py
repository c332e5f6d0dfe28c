"""The payload byte budget (--max-inflight-bytes) shared by every front end."""

from __future__ import annotations

from .grants import FifoGrants


class ByteBudget:
    """Bounds the payload bytes held by all requests together (RPC payloads, HTTP state
    uploads, KV pulls): a request whose payload does not fit waits (its sender is held back
    by TCP) until others release theirs. Waiters are served in arrival order: a stream of
    small payloads cannot starve a large one."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
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

    def release(self, n: int) -> None:
        self.used -= n
        self._line.serve()
