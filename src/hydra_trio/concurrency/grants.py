"""A first-come-first-served line for a resource that is granted by whoever frees it (the
payload byte budget, the slot table): one ParkingLot, the grant made in the same tick as the
release that allows it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

R = TypeVar("R")  # what a waiter asks for
G = TypeVar("G")  # what it is granted


@dataclass(eq=False, slots=True)
class _Ticket(Generic[R, G]):
    request: R
    task: trio.lowlevel.Task
    grant: G | None = None


class FifoGrants(Generic[R, G]):
    """Waiters are served oldest first: while the oldest one's request cannot be taken, nobody
    behind it is served (a stream of small requests cannot starve a large one), and a newcomer
    waits behind the line even when its request could be taken now.

    ``take(request)`` takes the resource for a request (the owner's policy) and returns the
    grant, or None when it is not available now. The owner calls ``serve()`` after each
    release. A grant goes only to a task still parked in the lot, and waking it from there
    cannot fail, so a cancelled waiter never holds a grant: no grant is lost or doubled.
    """

    def __init__(self, take: Callable[[R], G | None]) -> None:
        self._take = take
        self._lot = trio.lowlevel.ParkingLot()
        self._line: deque[_Ticket[R, G]] = deque()

    def __len__(self) -> int:
        """Waiters in line."""
        return len(self._line)

    async def acquire(self, request: R) -> G:
        """The grant for ``request``, at once when nobody waits and it can be taken, else in
        turn; no deadline of its own: the caller's cancel scope bounds the wait, and a
        cancelled wait takes nothing."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._line and (grant := self._take(request)) is not None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return grant
        ticket: _Ticket[R, G] = _Ticket(request, trio.lowlevel.current_task())
        self._line.append(ticket)  # then parks at once: line order is lot order
        try:
            await self._lot.park()
        except BaseException:
            # Cancelled while parked (trio took it out of the lot): never granted.
            self._line.remove(ticket)
            self.serve()  # those behind it may be served now
            raise
        assert ticket.grant is not None
        return ticket.grant

    def serve(self) -> None:
        """Grant to the waiters oldest first, while the oldest one's request can be taken.

        A waiter cancelled in this tick has left the lot but not yet the line; until it
        leaves (its leaving calls this again) nothing is granted, so the oldest live waiter
        is never passed over and the grant never goes to the cancelled one."""
        while self._line and len(self._lot) == len(self._line):
            head = self._line[0]
            grant = self._take(head.request)
            if grant is None:
                return
            self._line.popleft()
            head.grant = grant
            woken = self._lot.unpark()
            assert woken == [head.task], "the lot and the line disagree"
