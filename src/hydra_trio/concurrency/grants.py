"""Lines for a resource that is granted by whoever frees it, the grant made in the same tick as
the release that allows it: first come, first served (the payload byte budget), or cheapest
first with a bound on overtaking (the slot table)."""

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


@dataclass(eq=False, slots=True)
class _Costed(Generic[R, G]):
    request: R
    task: trio.lowlevel.Task
    cost: float
    passed: int = 0  # grants made to waiters that came after this one
    grant: G | None = None


class CheapestFirstGrants(Generic[R, G]):
    """Waiters are served cheapest first (the least expected work, the oldest among equals),
    but none is overtaken more than ``overtakes`` times: once the oldest waiter has been
    passed that often, it is served next. (A waiter is passed by every grant to one that came
    after it, so an older waiter has been passed at least as often as a younger one: the
    oldest reaches the bound first, and nobody goes past it.) ``overtakes=0`` is first come,
    first served. For a resource every waiter can take as soon as any can (a free slot);
    ``FifoGrants`` keeps a large request from being starved by small ones where that differs.

    ``take(request)`` as in ``FifoGrants``; ``acquire``'s ``cost`` is asked once, and only
    when the waiter has to wait. A cancelled waiter leaves the line in the tick it is
    cancelled (its abort), so a grant only ever goes to a live waiter.
    """

    def __init__(self, take: Callable[[R], G | None], overtakes: int) -> None:
        self._take = take
        self.overtakes = overtakes
        self._line: list[_Costed[R, G]] = []  # in order of arrival

    def __len__(self) -> int:
        """Waiters in line."""
        return len(self._line)

    async def acquire(self, request: R, cost: Callable[[], float]) -> G:
        """The grant for ``request``, at once when nobody waits and it can be taken, else in
        its turn; the caller's cancel scope bounds the wait, and a cancelled wait takes
        nothing."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._line and (grant := self._take(request)) is not None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return grant
        ticket: _Costed[R, G] = _Costed(request, trio.lowlevel.current_task(), cost())
        self._line.append(ticket)

        def abort(_: object) -> trio.lowlevel.Abort:
            self._line.remove(ticket)  # never granted: grants take the ticket out first
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        assert ticket.grant is not None
        return ticket.grant

    def serve(self) -> None:
        """Grant to the waiters in their order (``_next``) while the resource can be taken."""
        while self._line:
            i = self._next()
            ticket = self._line[i]
            grant = self._take(ticket.request)
            if grant is None:
                return
            del self._line[i]
            for older in self._line[:i]:
                older.passed += 1
            ticket.grant = grant
            trio.lowlevel.reschedule(ticket.task)

    def _next(self) -> int:
        """The index of the waiter served next: the oldest once it was passed ``overtakes``
        times, else the cheapest (``min`` keeps the first, the oldest, among equals)."""
        line = self._line
        if line[0].passed >= self.overtakes:
            return 0
        return min(range(len(line)), key=lambda i: line[i].cost)
