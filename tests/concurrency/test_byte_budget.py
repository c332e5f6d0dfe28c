"""The payload budget: payloads that do not fit wait for others to be released."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
import trio.testing

from hydra_trio.concurrency import ByteBudget


async def test_a_payload_that_does_not_fit_waits_for_a_release() -> None:
    budget = ByteBudget(100)
    await budget.acquire(60)
    got_it = trio.Event()

    async def second() -> None:
        await budget.acquire(60)
        got_it.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert not got_it.is_set() and budget.used == 60
        budget.release(60)
        await got_it.wait()
    assert budget.used == 60


async def test_a_payload_larger_than_the_budget_runs_alone() -> None:
    budget = ByteBudget(100)
    await budget.acquire(500)  # nothing else held: it goes through instead of waiting forever
    assert budget.used == 500
    budget.release(500)
    assert budget.used == 0


async def test_an_empty_payload_never_waits() -> None:
    budget = ByteBudget(100)
    await budget.acquire(500)  # an oversized payload running alone: the budget is over full
    with trio.fail_after(1):
        await budget.acquire(0)  # e.g. INFO: holds nothing, so it need not wait for room
    assert budget.used == 500


async def test_a_cancelled_wait_for_room_takes_nothing() -> None:
    budget = ByteBudget(100)
    await budget.acquire(80)
    with trio.move_on_after(0.01) as wait:  # the caller's deadline
        await budget.acquire(80)
    assert wait.cancelled_caught and budget.used == 80
    with trio.CancelScope() as scope:
        scope.cancel()
        await budget.acquire(10)  # would fit, but the caller is already cancelled
    assert budget.used == 80


async def test_a_live_engine_answers_busy_when_payload_memory_stays_full(start_engine: Any, tiny_model: Path) -> None:
    """One connection's STATE_PUT holds the whole payload budget (its op waits for the GPU
    worker, which the test holds); another request waits its idle timeout, then gets BUSY
    TIMEOUT, its payload drained: the same connection then works. (A PREFILL gives its small
    JSON back once parsed, so that its reply's charge does not wait behind it.)"""
    from helpers import assert_error, rpc
    from hydra_trio.rpc.client import configure_call, prefill_call, state_put_call
    from hydra_trio.wire import Status

    ep = await start_engine(tiny_model, max_inflight_bytes=200, idle_timeout_s=0.3)
    request = {"messages": [{"role": "user", "content": "x" * 80}], "max_tokens": 1}
    first_done = trio.Event()
    async with await rpc(ep) as holder, await rpc(ep) as other:
        blob = (await holder.call(prefill_call(0, request))).payload  # larger than the budget: runs alone

        async def hold_budget() -> None:
            await holder.call(state_put_call(1, bytes(blob)))
            first_done.set()

        async with trio.open_nursery() as nursery:
            async with ep.state.engine._core.worker.limiter:
                nursery.start_soon(hold_budget)
                await trio.testing.wait_all_tasks_blocked()
                assert ep.state.payload_budget.used >= len(blob)
                resp = await other.call(configure_call(0, {"n_predict": 4, "pad": "y" * 150}), check=False)
                assert_error(resp, Status.BUSY, "TIMEOUT")
            await first_done.wait()
        ok = await other.call(configure_call(0, {"n_predict": 4}))
        assert ok.meta["success"] is True
    assert ep.state.payload_budget.used == 0  # every charge (payloads, the PREFILL reply) given back


async def test_waiters_are_served_in_arrival_order() -> None:
    """A large payload that waits is not overtaken by small ones that arrive after it (they
    would fit, and keep fitting, forever); a waiter that leaves lets those behind it in."""
    budget = ByteBudget(100)
    await budget.acquire(60)
    order: list[str] = []

    async def take(name: str, n: int) -> None:
        await budget.acquire(n)
        order.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take, "large", 90)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(take, "small", 20)  # fits now, but arrived after the large one
        await trio.testing.wait_all_tasks_blocked()
        assert order == [] and budget.used == 60
        budget.release(60)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["large"] and budget.used == 90  # the small one does not fit beside it
        budget.release(90)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["large", "small"] and budget.used == 20
    budget.release(20)
    # A waiter cancelled while queued lets the next one through.
    await budget.acquire(95)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take, "cancelled", 50)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(take, "behind", 5)
            await trio.testing.wait_all_tasks_blocked()
            assert order[-1] == "small"
            scope.cancel()
    assert budget.used == 95
    await budget.acquire(5)
    assert budget.used == 100



async def test_a_release_in_the_tick_of_a_cancel_goes_to_the_next_in_line() -> None:
    """The oldest waiter is cancelled and, before it runs again, room is released: the
    cancelled one takes nothing, the one behind it gets the room (grants.FifoGrants)."""
    budget = ByteBudget(100)
    await budget.acquire(100)
    got: list[str] = []
    scopes: dict[str, trio.CancelScope] = {}

    async def take(name: str, n: int) -> None:
        with trio.CancelScope() as scopes[name]:
            await budget.acquire(n)
            got.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take, "head", 50)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(take, "behind", 60)
        await trio.testing.wait_all_tasks_blocked()
        assert budget.waiting == 2
        scopes["head"].cancel()  # out of the lot at once; out of the line once it runs
        budget.release(100)  # in the same tick
        await trio.testing.wait_all_tasks_blocked()
    assert got == ["behind"] and budget.used == 60 and budget.waiting == 0
