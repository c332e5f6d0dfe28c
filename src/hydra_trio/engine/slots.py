"""Slot claims: a slot is busy from the moment a request claims it until that request ends."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from ..wire.errors import ErrorCode, ProtocolError


@dataclass(slots=True)
class Slot:
    id: int
    owner: str | None = None  # what holds it, for logs and /slots
    last_used: float = 0.0
    transferring: bool = False  # a STATE_GET/PUT is moving its bytes

    @property
    def busy(self) -> bool:
        return self.owner is not None


class SlotTable:
    def __init__(self, n_slots: int) -> None:
        self.slots = [Slot(i) for i in range(n_slots)]
        self._released = trio.Event()
        self.frozen = False  # true while a staged context rebuild / model reload runs
        self.waiting = 0  # requests waiting in claim_any for a free slot (vllm:num_requests_waiting)

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

    async def claim_any(self, owner: str, score: Callable[[int], tuple[int, ...]]) -> Slot:
        """Claim the free slot with the highest score (the engine's slot-choice policy), the
        least recently used among equals, waiting for one for as long as the caller's scope
        allows."""
        while True:
            free = [s for s in self.slots if not s.busy]
            if free and not self.frozen:
                best = max(free, key=lambda s: (score(s.id), -s.last_used))
                best.owner = owner
                return best
            self.waiting += 1
            try:
                await self._released.wait()
            finally:
                self.waiting -= 1

    def release(self, slot: Slot) -> None:
        slot.owner = None
        slot.transferring = False
        slot.last_used = time.monotonic()
        self.notify()

    async def wait_released(self) -> None:
        await self._released.wait()

    def notify(self) -> None:
        self._released.set()
        self._released = trio.Event()

    def all_idle(self) -> bool:
        return not any(s.busy for s in self.slots)
