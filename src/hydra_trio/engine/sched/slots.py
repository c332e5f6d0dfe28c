"""Slot claims: a slot is busy from the moment a request claims it until that request ends."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from ...concurrency import CheapestFirstGrants
from ...wire.errors import ErrorCode, ProtocolError


@dataclass(slots=True)
class Slot:
    id: int
    owner: str | None = None  # what holds it, for logs and /slots
    last_used: float = 0.0
    transferring: bool = False  # a STATE_GET/PUT is moving its bytes

    @property
    def busy(self) -> bool:
        return self.owner is not None


Score = Callable[[int], tuple[float, ...]]


class SlotTable:
    def __init__(self, n_slots: int, *, compact: bool = False, overtakes: int = 0) -> None:
        self.slots = [Slot(i) for i in range(n_slots)]
        # Split KV cache: llama.cpp puts only consecutive sequence ids into one ubatch (a
        # forward pass of its own), so a step over busy slots 0, 2, 4, ... costs a pass per
        # slot. Among slots the policy scores alike, ``compact`` prefers one next to busy
        # slots (filling a gap, then extending a run) before the least recently used one.
        self.compact = compact
        self._released = trio.Event()
        self.frozen = False  # true while a staged context rebuild / model reload runs
        # Requests waiting in claim_any: a freed slot goes to the one with the least work
        # expected (a turn whose history a slot or the prompt cache holds before one that
        # computes its prompt), but no waiter is overtaken more than ``overtakes`` times (a
        # cold request is not starved into a 503); 0: first come, first served.
        self._line: CheapestFirstGrants[tuple[str, Score], Slot] = CheapestFirstGrants(self._take, overtakes)

    @property
    def waiting(self) -> int:
        """Requests waiting for a free slot (vllm:num_requests_waiting)."""
        return len(self._line)

    @property
    def n_busy(self) -> int:
        """Slots claimed right now: the one count every reader gets (``Engine.stats``)."""
        return sum(s.busy for s in self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def get(self, slot_id: int) -> Slot:
        if not 0 <= slot_id < len(self.slots):
            raise ProtocolError(ErrorCode.NO_SLOT, f"no slot {slot_id} (slots 0..{len(self.slots) - 1})")
        return self.slots[slot_id]

    def claim(self, slot_id: int, owner: str) -> Slot:
        slot = self.get(slot_id)
        if slot.busy or self.frozen:
            why = "engine is reconfiguring" if self.frozen else f"slot {slot_id} is busy ({slot.owner})"
            raise ProtocolError(ErrorCode.SLOT_BUSY, why)
        slot.owner = owner
        return slot

    async def claim_any(self, owner: str, score: Score, cost: Callable[[], float] = lambda: 0.0) -> Slot:
        """Claim the free slot with the highest score (the engine's slot-choice policy), the
        least recently used among equals, waiting in line for one for as long as the caller's
        scope allows: cheapest ``cost`` first (asked once, when the request has to wait; the
        prompt tokens it would compute), overtaken at most ``overtakes`` times."""
        return await self._line.acquire((owner, score), cost)

    def _take(self, request: tuple[str, Score]) -> Slot | None:
        owner, score = request
        if self.frozen:
            return None
        slots = self.slots
        busy = [s.busy for s in slots]  # read once: the tie-break below reads each twice
        free = [s for s, b in zip(slots, busy, strict=True) if not b]
        if not free:
            return None
        if self.compact:
            # 0, 1 or 2 busy neighbours: taking the slot adds a run of consecutive busy
            # slots, extends one, or joins two (a step over the busy slots then needs one
            # llama.cpp ubatch fewer). ``beside[i + 1]``: whether slot i is busy.
            beside = [False, *busy, False]
            slot = max(free, key=lambda s: (score(s.id), beside[s.id] + beside[s.id + 2], -s.last_used))
        else:
            slot = max(free, key=lambda s: (score(s.id), -s.last_used))
        slot.owner = owner
        return slot

    def release(self, slot: Slot) -> None:
        slot.owner = None
        slot.transferring = False
        slot.last_used = time.monotonic()
        self.notify()

    async def wait_released(self) -> None:
        await self._released.wait()

    def notify(self) -> None:
        self._line.serve()
        self._released.set()
        self._released = trio.Event()

    def all_idle(self) -> bool:
        return self.n_busy == 0
