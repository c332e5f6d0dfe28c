"""The step batcher's scheduling policy, with stand-in llama calls: which prompt parts and
steps share a batch."""

from __future__ import annotations

import threading
from typing import Any

import trio
import trio.testing

from helpers import Recorder, no_wait, wait_until
from hydra_trio.engine.sched import StepBatcher


def new_batcher(rec: Recorder, *, budget: int = 8, alone: int = 64) -> StepBatcher:
    return StepBatcher(
        4, rec.step_sync, rec.run_on_worker, rec.run_mixed, token_budget=budget, alone_budget=alone,
        worker_free=no_wait, is_eog=lambda t: t == 0, wants_turn=threading.Event(),
    )


async def test_prompts_waiting_together_share_one_batch() -> None:
    rec = Recorder()
    batcher = new_batcher(rec)
    got: dict[int, Any] = {}
    async with trio.open_nursery() as nursery:
        for slot in range(3):

            async def one(slot: int = slot) -> None:
                got[slot] = await batcher.prefill(slot, list(range(10)), 0, sampler=None, want_logits=False)

            nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(batcher.run)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    # No stream runs: the three prompts fill one prefill chunk together.
    steps, parts = rec.batches[0]
    assert steps == [] and sorted(parts) == [(0, 10), (1, 10), (2, 10)]
    assert got == {0: (7, None), 1: (7, None), 2: (7, None)}


async def test_with_streams_each_waiting_prompt_advances_by_a_budget() -> None:
    rec = Recorder()
    batcher = new_batcher(rec, budget=8)
    async with trio.open_nursery() as nursery:
        batcher.generating = 2
        jobs = [batcher.submit(slot, 1, object(), 1) for slot in (0, 1)]  # type: ignore[arg-type]
        for slot in (2, 3):

            async def one(slot: int = slot) -> None:
                await batcher.prefill(slot, list(range(20)), 0, sampler=None, want_logits=False)

            nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(batcher.run)
        for job in jobs:
            assert await batcher.result(job) == (2,)
        await wait_until(lambda: len(rec.batches) >= 2)
        nursery.cancel_scope.cancel()
    # The streams' step goes alone first (the ITL target's price of their step, measured).
    assert rec.batches[0] == ([0, 1], [])
    # Then the first prompt gets the budget less the streams (8 - 2: the cost of a prompt
    # token is not measured yet), the next a whole budget; the streams, still generating,
    # count though their steps are not in this batch.
    steps, parts = rec.batches[1]
    assert steps == []
    assert sorted(slot for slot, _ in parts) == [2, 3] and [n for _, n in parts] == [6, 8]


async def test_a_step_whose_token_goes_on_is_started_before_the_request_asks() -> None:
    rec = Recorder()
    batcher = new_batcher(rec)
    sampler: Any = object()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batcher.run)
        batcher.generating = 1
        job = batcher.submit(0, 1, sampler, 3)  # may produce 3 more tokens
        assert await batcher.result(job) == (2,)
        await wait_until(lambda: rec.calls_returned == 1)
        # Token 2's step ran in the same worker call, without being asked for; none after
        # it until the request takes it (one step ahead at most, however slow the request).
        assert [b[0] for b in rec.batches] == [[0], [0]]
        nxt = batcher.submit(0, 2, sampler, 2)
        assert nxt.done.is_set() and await batcher.result(nxt) == (3,)
        await trio.testing.wait_all_tasks_blocked()
        assert len(rec.batches) == 2 and batcher.ahead_used == 1
        last = batcher.submit(0, 3, sampler, 1)  # the last token allowed: nothing after it
        assert await batcher.result(last) == (4,)
        await wait_until(lambda: rec.calls_returned == 2)
        assert len(rec.batches) == 3 and batcher.ahead_used == 1
        # A request that stops (a stop word) drops a step it did not ask for.
        job = batcher.submit(1, 0 + 10, sampler, 5)
        batcher.generating = 2
        assert await batcher.result(job) == (11,)
        await batcher.drop_ahead(1)
        assert batcher.ahead_dropped == 1
        nursery.cancel_scope.cancel()


async def test_slot_waiters_are_served_first_come_first_served() -> None:
    """When the one slot frees, the request that has waited longest gets it, whatever a
    later one's prefix score; one that gave up waiting is skipped."""
    from hydra_trio.engine.sched import SlotTable

    table = SlotTable(1)
    holder = table.claim(0, "holder")
    got: list[str] = []
    scopes: dict[str, trio.CancelScope] = {}

    async def want(name: str, score: int) -> None:
        with trio.CancelScope() as scopes[name]:
            slot = await table.claim_any(name, lambda _i: (score,))
            got.append(name)
            table.release(slot)

    async with trio.open_nursery() as nursery:
        for name, score in (("first", 0), ("gives-up", 5), ("second", 9)):
            nursery.start_soon(want, name, score)
            await trio.testing.wait_all_tasks_blocked()
        assert table.waiting == 3
        scopes["gives-up"].cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert table.waiting == 2
        table.release(holder)
    assert got == ["first", "second"]
    assert table.waiting == 0 and not table.slots[0].busy


async def test_a_slot_freed_in_the_tick_of_a_cancel_goes_to_the_next_in_line() -> None:
    """The oldest waiter is cancelled and the slot freed before it runs again: it is not
    granted the slot (so it cannot leak it), the next waiter is."""
    from hydra_trio.engine.sched import SlotTable

    table = SlotTable(1)
    holder = table.claim(0, "holder")
    got: list[str] = []
    scopes: dict[str, trio.CancelScope] = {}

    async def want(name: str) -> None:
        with trio.CancelScope() as scopes[name]:
            await table.claim_any(name, lambda _i: (0,))
            got.append(name)

    async with trio.open_nursery() as nursery:
        for name in ("cancelled", "next"):
            nursery.start_soon(want, name)
            await trio.testing.wait_all_tasks_blocked()
        scopes["cancelled"].cancel()
        table.release(holder)  # the same tick
    assert got == ["next"] and table.slots[0].owner == "next" and table.waiting == 0


async def test_prompts_of_the_calls_queued_ahead_join_the_batch() -> None:
    """The worker reports calls that were queued ahead of the batch (a burst's tokenizations,
    GpuWorker.wait_for_calls_ahead): the prompts their requests hand in a tick after those
    return share the batch with the prompt that was waiting. With none reported, the batch
    goes at once, the late prompt in the next one (the burst split, issue 53)."""
    for ahead, expected in ((1, [[(0, 10), (1, 10)]]), (0, [[(0, 10)], [(1, 10)]])):
        rec = Recorder()
        async with trio.open_nursery() as nursery:
            batcher: StepBatcher

            async def late_request() -> None:
                await trio.lowlevel.checkpoint()  # its tokenization returned: a tick to its prefill
                await batcher.prefill(1, list(range(10)), 0, sampler=None, want_logits=False)  # noqa: B023

            async def worker_free(ahead: int = ahead, rec: Recorder = rec) -> int:
                if not rec.batches:
                    nursery.start_soon(late_request)
                return ahead

            batcher = StepBatcher(
                4, rec.step_sync, rec.run_on_worker, rec.run_mixed, token_budget=8, alone_budget=64,
                worker_free=worker_free, is_eog=lambda t: t == 0, wants_turn=threading.Event(),
            )

            async def first() -> None:
                await batcher.prefill(0, list(range(10)), 0, sampler=None, want_logits=False)  # noqa: B023

            nursery.start_soon(first)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(batcher.run)
            await wait_until(lambda: sum(len(parts) for _, parts in rec.batches) >= 2)  # noqa: B023
            nursery.cancel_scope.cancel()
        assert [sorted(parts) for _, parts in rec.batches] == expected, ahead
