"""decode.store.ResultStore and IdAllocator with an injected clock (spec §4.3 ids, §6.4)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import trio

from hydra_trio.decode.store import (
    DecodeEntry,
    DecodeState,
    IdAllocator,
    ResultStore,
    Subscription,
    Tombstone,
)
from hydra_trio.wire import ErrorCode, ProtocolError, Status

INT32_MAX = (1 << 31) - 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


def make(ttl_s: float = 10.0, max_entries: int = 3) -> tuple[ResultStore, FakeClock]:
    clock = FakeClock()
    return ResultStore(ttl_s=ttl_s, max_entries=max_entries, clock=clock), clock


def state_of(s: ResultStore, rid: int) -> DecodeState | None:
    found = s.get(rid)
    return None if found is None else found.state


def test_new_entries_are_running_and_findable() -> None:
    s, _ = make()
    e = s.create(slot_id=1)
    assert isinstance(e, DecodeEntry)
    assert e.state == DecodeState.VALIDATING and e.running and e.slot_id == 1
    assert s.get(e.id) is e
    assert s.running() == [e] and s.entries() == [e] and len(s) == 1


def test_full_store_evicts_the_oldest_finished_entry_only() -> None:
    s, clock = make(max_entries=3)
    a, b, c = s.create(0), s.create(0), s.create(0)
    clock.advance(1)
    s.finish(b, DecodeState.FAILED)  # b and c finished, a (the oldest) is still running
    clock.advance(1)
    s.finish(c, DecodeState.DONE)
    d = s.create(0)  # evicts the oldest finished entry: b, never the running a
    assert state_of(s, a.id) == DecodeState.VALIDATING
    assert state_of(s, b.id) == DecodeState.EVICTED and isinstance(s.get(b.id), Tombstone)
    assert s.get(c.id) is c and c.state == DecodeState.DONE
    assert s.get(d.id) is d
    assert s.evictions == 1
    e = s.create(0)  # then c
    assert state_of(s, c.id) == DecodeState.EVICTED
    assert {x.id for x in s.entries()} == {a.id, d.id, e.id}


def test_store_full_of_running_entries_refuses_and_writes_nothing() -> None:
    s, _ = make(max_entries=2)
    a, b = s.create(0), s.create(1)
    before = [x.id for x in s.entries()]
    with pytest.raises(ProtocolError) as info:
        s.create(0)
    assert info.value.code == ErrorCode.RESULT_STORE_FULL
    assert info.value.status == Status.BUSY
    assert [x.id for x in s.entries()] == before
    assert a.running and b.running and s.evictions == 0
    # As soon as one of them finishes, there is room again.
    s.finish(a, DecodeState.DONE)
    c = s.create(0)
    assert state_of(s, a.id) == DecodeState.EVICTED and s.get(c.id) is c


def test_finished_entries_live_for_the_ttl_counted_from_their_end() -> None:
    s, clock = make(ttl_s=10.0)
    e = s.create(0)
    clock.advance(100)  # a long-running request: the TTL does not count while it runs
    assert s.get(e.id) is e
    s.finish(e, DecodeState.DONE)
    assert e.ended_at == clock.now
    clock.advance(9.9)
    assert s.get(e.id) is e
    clock.advance(0.1)
    assert state_of(s, e.id) == DecodeState.EVICTED
    assert len(s) == 0


def test_running_entries_never_expire() -> None:
    s, clock = make(ttl_s=1.0)
    e = s.create(0)
    clock.advance(1e6)
    s.sweep()
    assert s.get(e.id) is e and e.running


def test_tombstones_expire_after_the_ttl() -> None:
    s, clock = make(ttl_s=10.0)
    cancelled, timed_out, done = s.create(0), s.create(0), s.create(0)
    s.finish(cancelled, DecodeState.CANCELLED)
    s.finish(timed_out, DecodeState.TIMED_OUT)
    s.finish(done, DecodeState.DONE)
    s.delete(done)
    assert state_of(s, cancelled.id) == DecodeState.CANCELLED
    assert state_of(s, timed_out.id) == DecodeState.TIMED_OUT
    assert state_of(s, done.id) == DecodeState.DELETED
    assert cancelled.chunks == [] and len(s) == 0  # a tombstone keeps no text
    clock.advance(9.99)
    assert all(isinstance(s.get(x.id), Tombstone) for x in (cancelled, timed_out, done))
    clock.advance(0.01)
    assert s.get(cancelled.id) is None and s.get(timed_out.id) is None and s.get(done.id) is None


def test_evicted_tombstone_expires_ttl_after_eviction() -> None:
    s, clock = make(ttl_s=10.0)
    e = s.create(0)
    s.finish(e, DecodeState.DONE)
    clock.advance(10)
    assert state_of(s, e.id) == DecodeState.EVICTED  # evicted now, tombstone starts now
    clock.advance(9.9)
    assert state_of(s, e.id) == DecodeState.EVICTED
    clock.advance(0.1)
    assert s.get(e.id) is None


def test_tombstones_are_bounded() -> None:
    s, _ = make(ttl_s=1e9, max_entries=2)
    ids = []
    for _ in range(s.max_tombstones + 10):
        e = s.create(0)
        s.finish(e, DecodeState.CANCELLED)
        ids.append(e.id)
    assert all(s.get(i) is None for i in ids[:10])  # oldest tombstones dropped
    assert all(isinstance(s.get(i), Tombstone) for i in ids[10:])


@pytest.mark.parametrize("late", [DecodeState.DONE, DecodeState.FAILED, DecodeState.CANCELLED])
def test_finishing_task_cannot_reinsert_a_cancelled_entry(late: DecodeState) -> None:
    s, _ = make()
    e = s.create(0)
    s.finish(e, DecodeState.CANCELLED)
    s.finish(e, late)
    assert state_of(s, e.id) == DecodeState.CANCELLED
    assert len(s) == 0 and e.state == DecodeState.CANCELLED


@pytest.mark.parametrize("late", [DecodeState.DONE, DecodeState.FAILED, DecodeState.CANCELLED])
def test_finishing_task_cannot_reinsert_a_deleted_or_evicted_entry(late: DecodeState) -> None:
    s, clock = make(ttl_s=10.0, max_entries=1)
    deleted = s.create(0)
    s.finish(deleted, DecodeState.DONE)
    s.delete(deleted)
    s.finish(deleted, late)
    assert state_of(s, deleted.id) == DecodeState.DELETED and len(s) == 0

    evicted = s.create(0)
    s.finish(evicted, DecodeState.DONE)
    clock.advance(10)
    s.sweep()
    s.finish(evicted, late)
    assert state_of(s, evicted.id) == DecodeState.EVICTED and len(s) == 0
    # Evicted for room (store full) rather than by TTL: same.
    first = s.create(0)
    s.finish(first, DecodeState.DONE)
    second = s.create(0)
    assert state_of(s, first.id) == DecodeState.EVICTED
    s.finish(first, late)
    assert state_of(s, first.id) == DecodeState.EVICTED
    assert [x.id for x in s.entries()] == [second.id]


def test_finish_twice_keeps_the_first_end() -> None:
    s, clock = make()
    e = s.create(0)
    s.finish(e, DecodeState.DONE)
    ended = e.ended_at
    clock.advance(5)
    s.finish(e, DecodeState.FAILED)
    assert e.state == DecodeState.DONE and e.ended_at == ended


def test_delete_of_running_or_foreign_entry_is_a_no_op_for_the_store() -> None:
    s, _ = make()
    e = s.create(0)
    s.finish(e, DecodeState.CANCELLED)
    s.delete(e)  # already a tombstone
    assert state_of(s, e.id) == DecodeState.CANCELLED


def test_subscribers_are_woken_and_closed_when_an_entry_ends() -> None:
    s, _ = make()
    e = s.create(0)
    recv = e.subscribe().wakeups
    e.notify()
    e.notify()  # capacity 1: coalesced, never blocks
    recv.receive_nowait()
    s.finish(e, DecodeState.DONE)
    recv.receive_nowait()  # the final wake-up
    with pytest.raises(trio.EndOfChannel):
        recv.receive_nowait()


class _TakesAll:
    """A ChunkSink whose socket takes every chunk whole."""

    def send_now(self, data: bytes) -> bytes | None:
        return b""

    async def send_rest(self, rest: bytes) -> None:
        return None


def _leave_sink(sub: Subscription, sink: Any) -> None:
    """What a waiting SSE reader does: a sink, and its write turn handed over."""
    sub.sink = sink
    sub.turn.attach(_TakesAll(), str.encode)
    sub.turn.hand_over()


def test_a_reader_s_sink_takes_a_change_instead_of_a_wake_up_unless_it_declines() -> None:
    s, _ = make()
    e = s.create(0)
    sub, other = e.subscribe(), e.subscribe()
    taken: list[bool] = []
    _leave_sink(sub, lambda: taken.append(True) or True)
    e.notify()
    assert taken == [True]
    with pytest.raises(trio.WouldBlock):
        sub.wakeups.receive_nowait()  # it took it: not woken
    other.wakeups.receive_nowait()  # a reader without a sink is woken as before
    _leave_sink(sub, lambda: False)
    e.notify()
    sub.wakeups.receive_nowait()  # declined: woken
    e.unsubscribe(sub)
    assert e.reader_count == 1


def test_a_sink_that_declines_is_not_called_again_until_its_reader_sets_one() -> None:
    """A sink that declined (a chunk only partly written) handed the reader its turn: a
    change before the reader runs must wake it again, never reach the sink, which would
    write the next chunk before the rest of the last (a corrupt stream)."""
    s, _ = make()
    e = s.create(0)
    sub = e.subscribe()
    calls: list[bool] = []
    _leave_sink(sub, lambda: calls.append(True) and False)
    e.notify()
    e.notify()  # the reader has not run yet
    assert calls == [True] and not sub.turn.direct
    sub.wakeups.receive_nowait()  # woken (the two wake-ups coalesced)


def test_ids_are_positive_int32_and_unique_among_live_entries_and_tombstones() -> None:
    s, _ = make(max_entries=4)
    held: set[int] = set()
    for _ in range(5_000):
        e = s.create(0)
        assert 0 < e.id <= INT32_MAX
        assert e.id not in held  # a live entry's or a remembered tombstone's id is never reissued
        s.finish(e, DecodeState.DONE)
        held = {x.id for x in s.entries()} | set(s._tombstones)


def test_a_draw_that_is_zero_or_taken_is_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    draws = iter([0, 7, 7, 9])
    monkeypatch.setattr("hydra_trio.decode.store.secrets.randbits", lambda bits: next(draws))
    alloc = IdAllocator(taken=lambda i: i == 7)
    assert alloc.next() == 9


_OLD_MASK = (1 << 31) - 1
_OLD_A = 0x2C1B3C6D


def _old_tail(x: int) -> int:
    """The allocator's former unkeyed steps after its keyed affine one (`counter * A + key`)."""
    m = _OLD_MASK
    x ^= x >> 15
    x = (x * 0x297A2D39) & m
    x ^= x >> 12
    x = (x * 0x5BD1E995) & m
    x ^= x >> 16
    return x


def _unshift(y: int, k: int) -> int:
    x = y
    for _ in range(31 // k + 1):
        x = y ^ (x >> k)
    return x & _OLD_MASK


def _old_tail_inverse(y: int) -> int:
    m = _OLD_MASK
    x = _unshift(y, 16)
    x = (x * pow(0x5BD1E995, -1, 1 << 31)) & m
    x = _unshift(x, 12)
    x = (x * pow(0x297A2D39, -1, 1 << 31)) & m
    return _unshift(x, 15)


def _predict_next(one_id: int) -> int:
    """The attack of issue 50: invert the tail, step the affine counter, mix again."""
    return _old_tail((_old_tail_inverse(one_id) + _OLD_A) & _OLD_MASK)


def test_one_id_does_not_predict_the_next() -> None:
    # The attack is real: on the former allocator it predicts every next id from one id.
    key, counter = 0x5A5A5A5A, 41
    old = [_old_tail((n * _OLD_A + key) & _OLD_MASK) for n in range(counter, counter + 50)]
    assert all(_predict_next(a) == b for a, b in itertools.pairwise(old))
    # The allocator now: no id predicts the next one, nor any later one.
    s, _ = make(max_entries=10_000)
    ids = [s.create(0).id for _ in range(5_000)]
    predicted = {_predict_next(i) for i in ids}
    assert not predicted & set(ids[1:])


def test_ids_come_from_the_csprng(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def randbits(bits: int) -> int:
        calls.append(bits)
        return 12345

    monkeypatch.setattr("hydra_trio.decode.store.secrets.randbits", randbits)
    s, _ = make()
    assert s.create(0).id == 12345 and calls == [31]


def test_two_stores_use_different_id_sequences() -> None:
    a, _ = make()
    b, _ = make()
    assert [a.create(0).id for _ in range(3)] != [b.create(0).id for _ in range(3)]
