"""Bounded store of decode requests: live entries, finished results (TTL), tombstones.

Only finished entries are evicted (oldest first). A task finishing after its entry was
deleted, cancelled or evicted cannot bring it back: entries leave the store only through
here, and sealing checks the entry is still the one the store holds.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import trio

from ..concurrency import WriterTurn
from ..engine import turn_receipt
from ..wire.errors import ErrorCode, ProtocolError


@dataclass(slots=True)
class DecodeTimings:
    """What one DECODE measured and found on its way (its ``hydra_metrics``, the reply's
    meta, the request log line): filled in by decode/manager.py as it goes."""

    kv_bytes: int = 0  # the kv segment's size
    match: dict[str, Any] = field(default_factory=dict)  # the identity gate's answer
    validate_ms: float = 0.0
    queue_wait_ms: float = 0.0  # for the GPU worker, before the restore
    restore_slot_ms: float = 0.0
    n_past_after_restore: int = 0
    t3_reloaded: bool = False  # a model reload happened since the previous DECODE
    t3_reload_ms: float = 0.0
    decode_init_ms: float = 0.0  # the rest of the time to the reply
    acked_at: float | None = None  # perf_counter() when the reply was written
    ttft_ms: float = 0.0  # reply -> first token
    n_past: int | None = None  # what the slot held once the prompt was in


class DecodeState(StrEnum):
    VALIDATING = "validating"
    RESTORING = "restoring"
    GENERATING = "generating"
    DONE = "done"
    FAILED = "failed"
    # tombstones
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    EVICTED = "evicted"
    DELETED = "deleted"


RUNNING = {DecodeState.VALIDATING, DecodeState.RESTORING, DecodeState.GENERATING}
FINISHED = {DecodeState.DONE, DecodeState.FAILED}


class IdAllocator:
    """Decode ids: positive int32s drawn from the operating system's CSPRNG (``secrets``).

    An id is the only credential a reader of a decode holds (docs/operations.md, security),
    so no id may tell anything about another: each is an independent draw, never one derived
    from a counter (a keyed mix of a counter is inverted from one id and predicts them all).
    A draw that is 0 or still names a live entry or a tombstone (``taken``) is drawn again.
    """

    _BITS = 31

    def __init__(self, taken: Callable[[int], bool]) -> None:
        self._taken = taken

    def next(self) -> int:
        # 2^31 ids against a store bounded to thousands: a redraw is a rare event.
        while True:
            value = secrets.randbits(self._BITS)
            if value and not self._taken(value):
                return value


@dataclass(slots=True)
class Tombstone:
    id: int
    state: DecodeState
    ended_at: float
    receipt: dict[str, Any] | None = None  # a cut request's (engine/receipts.py): what it left


@dataclass(slots=True)
class DecodeEntry:
    id: int
    slot_id: int
    created_at: float
    created_unix: int = field(default_factory=lambda: int(time.time()))
    state: DecodeState = DecodeState.VALIDATING
    ended_at: float | None = None
    chunks: list[str] = field(default_factory=list)  # text deltas, in order
    error: str = ""
    error_code: str = ""
    result: Any = None  # engine GenerationResult once generating
    # A fresh parser of the reply's tool calls and reasoning per reading (None: text only).
    replies: Callable[[], Any] | None = None
    logprobs: bool = False  # the request asked for logprobs: its JSON result carries them
    turn: Any = None  # its agent session's turn (engine Turn): DELETE ends its tree with it
    metrics: DecodeTimings = field(default_factory=lambda: DecodeTimings())
    task: Any = None  # tasks.OwnedTask
    ended: trio.Event = field(default_factory=trio.Event)  # set once it left RUNNING
    _subscribers: list[Subscription] = field(default_factory=list)
    _waiting: int = 0  # readers in wait_ended

    @property
    def running(self) -> bool:
        return self.state in RUNNING

    @property
    def reader_count(self) -> int:
        """Readers of this entry: subscribed to its wake-ups (SSE streams) or waiting for its
        end (``?wait`` readers)."""
        return len(self._subscribers) + self._waiting

    async def wait_ended(self) -> None:
        """Until the entry leaves RUNNING (``ended``), for as long as the caller's scope allows."""
        self._waiting += 1
        try:
            await self.ended.wait()
        finally:
            self._waiting -= 1

    def subscribe(self) -> Subscription:
        """A reader's wake-ups (bounded, capacity 1): a message means "look again"; the
        reader reads new chunks from ``chunks`` by index, so a slow reader costs no memory."""
        send, recv = trio.open_memory_channel[None](1)
        sub = Subscription(recv, send)
        self._subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscribers = [s for s in self._subscribers if s is not sub]
        sub.wakeups.close()

    def notify(self) -> None:
        live = []
        for s in self._subscribers:
            if s.turn.direct and s.sink is not None:
                if s.sink():
                    live.append(s)  # it took what is new itself: no wake-up
                    continue
                # It declined, so the reader writes next (the rest of a chunk the sink
                # began comes first): until it hands the turn over again, changes wake it.
                s.turn.take_back()
            try:
                s.send.send_nowait(None)
            except trio.WouldBlock:
                pass  # a wake-up is already pending
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                continue
            live.append(s)
        self._subscribers = live

    def close_subscribers(self) -> None:
        for s in self._subscribers:
            s.send.close()
        self._subscribers = []


@dataclass(slots=True, eq=False)
class Subscription:
    """One reader of an entry. ``wakeups`` says "look again". A reader that writes its own
    socket may set a ``sink`` (what to write of the entry, through its ``turn``); while it
    waits it hands its ``turn`` over, and ``notify`` (in the task that changed the entry, at
    once) calls the sink instead of waking the reader. It wakes the reader only when the sink
    returns False (it could not take what is new, or the reader must see it itself), and
    takes the turn back then, so nothing reaches the sink before the reader has run."""

    wakeups: trio.MemoryReceiveChannel[None]
    send: trio.MemorySendChannel[None]
    turn: WriterTurn = field(default_factory=WriterTurn)
    sink: Callable[[], bool] | None = None


class ResultStore:
    def __init__(self, *, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[int, DecodeEntry] = OrderedDict()  # insertion order
        self._tombstones: OrderedDict[int, Tombstone] = OrderedDict()
        self.max_tombstones = max(64, 4 * max_entries)
        self.ids = IdAllocator(taken=self._holds_id)
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _holds_id(self, request_id: int) -> bool:
        return request_id in self._entries or request_id in self._tombstones

    def entries(self) -> list[DecodeEntry]:
        return list(self._entries.values())

    def running(self) -> list[DecodeEntry]:
        return [e for e in self._entries.values() if e.running]

    def get(self, request_id: int) -> DecodeEntry | Tombstone | None:
        self.sweep()
        return self._entries.get(request_id) or self._tombstones.get(request_id)

    def create(self, slot_id: int) -> DecodeEntry:
        """A new running entry; evicts the oldest finished entry if the store is full.

        Raises BUSY RESULT_STORE_FULL (nothing written) when every entry is still running.
        """
        self.sweep()
        if len(self._entries) >= self.max_entries:
            victim = next((e for e in self._entries.values() if not e.running), None)
            if victim is None:
                raise ProtocolError(
                    ErrorCode.RESULT_STORE_FULL,
                    f"result store full: {len(self._entries)} decode requests are still running",
                )
            self._bury(victim, DecodeState.EVICTED)
            self.evictions += 1
        entry = DecodeEntry(id=self.ids.next(), slot_id=slot_id, created_at=self.clock())
        self._entries[entry.id] = entry
        return entry

    def holds(self, entry: DecodeEntry) -> bool:
        return self._entries.get(entry.id) is entry

    def finish(self, entry: DecodeEntry, state: DecodeState) -> None:
        """Seal a running entry as done/failed, or bury it as cancelled/timed_out.

        No effect if the entry already left the store (deleted/evicted) or already ended.
        """
        if not self.holds(entry) or not entry.running:
            return
        entry.ended_at = self.clock()
        if state in FINISHED:
            entry.state = state
            entry.notify()
            entry.close_subscribers()
            entry.ended.set()
        else:
            self._bury(entry, state)

    def forget_unclaimed(self, entry: DecodeEntry) -> None:
        """A request whose id never reached its caller leaves as a "cancelled" tombstone,
        even if it finished before the caller's hang-up was known (nobody can read it)."""
        if self.holds(entry):
            self._bury(entry, DecodeState.CANCELLED)

    def delete(self, entry: DecodeEntry) -> None:
        """DELETE of a finished entry: it leaves the store as a "deleted" tombstone."""
        if self.holds(entry):
            self._bury(entry, DecodeState.DELETED)

    def _bury(self, entry: DecodeEntry, state: DecodeState) -> None:
        self._entries.pop(entry.id, None)
        entry.state = state
        if entry.ended_at is None:
            entry.ended_at = self.clock()
        entry.notify()
        entry.close_subscribers()
        entry.ended.set()
        entry.chunks = []  # a tombstone keeps no text
        receipt = turn_receipt(entry.result) if entry.result is not None else None
        self._tombstones[entry.id] = Tombstone(entry.id, state, self.clock(), receipt)
        while len(self._tombstones) > self.max_tombstones:
            self._tombstones.popitem(last=False)

    def sweep(self) -> None:
        """Finished entries older than the TTL become "evicted" tombstones; tombstones older
        than the TTL are forgotten."""
        now = self.clock()
        expired = [
            e
            for e in self._entries.values()
            if not e.running and e.ended_at is not None and now - e.ended_at >= self.ttl_s
        ]
        for e in expired:
            self._bury(e, DecodeState.EVICTED)
        while self._tombstones:
            first = next(iter(self._tombstones.values()))
            if now - first.ended_at < self.ttl_s:
                break
            self._tombstones.popitem(last=False)
