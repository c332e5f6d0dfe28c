"""The RPC payload budget: payloads that do not fit wait for others to be released."""

from __future__ import annotations

import trio
import trio.testing

from hydra_trio.rpc.connection import ByteBudget


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
