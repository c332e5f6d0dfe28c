"""The payload byte budget (--max-inflight-bytes) shared by every front end."""

from __future__ import annotations

from collections import deque

import trio


class ByteBudget:
    """Bounds the payload bytes held by all requests together (RPC payloads, HTTP state
    uploads, KV pulls): a request whose payload does not fit waits (its sender is held back
    by TCP) until others release theirs. Waiters are served in arrival order: a stream of
    small payloads cannot starve a large one."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self._waiters: deque[tuple[int, trio.Event]] = deque()

    def _fits(self, n: int) -> bool:
        # Zero bytes never wait; a payload larger than the whole budget runs alone.
        return n == 0 or self.used + n <= self.total or self.used == 0

    async def acquire(self, n: int) -> None:
        """Take ``n`` bytes once they fit and every earlier waiter has been served. No
        deadline of its own: the caller's cancel scope bounds the wait, and a cancelled wait
        takes nothing."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._waiters and self._fits(n):
            self.used += n
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        entry = (n, trio.Event())
        self._waiters.append(entry)
        try:
            await entry[1].wait()
        except BaseException:
            if entry[1].is_set():  # granted in the same tick as the cancellation
                self.release(n)
            else:
                self._waiters.remove(entry)
                self._grant()  # those behind it may fit now
            raise

    def release(self, n: int) -> None:
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, granted = self._waiters.popleft()
            self.used += n
            granted.set()
