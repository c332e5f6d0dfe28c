"""The line for a slot: a freed slot goes to the waiting request with the least work expected
(a turn whose history a slot or the prompt cache holds before one that computes its prompt),
and no waiter is overtaken more than ``--slot-overtakes`` times (benchmarks/agents.py: 16
agents' turns wait for 4 slots, and a later turn's TTFT was mostly that wait)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trio.testing

from helpers import http
from hydra_trio.engine.sched import SlotTable

SYSTEM = [300 + i % 200 for i in range(300)]


def _tokens(seed: int, n: int) -> list[int]:
    return [300 + (seed * 7919 + i * 104729) % 200 for i in range(n)]


async def _served_order(table: SlotTable, waiters: list[tuple[str, float]]) -> tuple[list[str], dict[str, int]]:
    """Hold the table's one slot while ``waiters`` (name, cost) line up in that order, then
    free it: the order they were granted it in (each frees it at once), and how often each
    one's cost was asked."""
    holder = table.claim(0, "holder")
    got: list[str] = []
    asked: dict[str, int] = {}

    async def want(name: str, cost: float) -> None:
        def work() -> float:
            asked[name] = asked.get(name, 0) + 1
            return cost

        slot = await table.claim_any(name, lambda _i: (0,), work)
        got.append(name)
        table.release(slot)

    async with trio.open_nursery() as nursery:
        for name, cost in waiters:
            nursery.start_soon(want, name, cost)
            await trio.testing.wait_all_tasks_blocked()
        assert table.waiting == len(waiters)
        table.release(holder)
    assert table.waiting == 0 and not table.slots[0].busy
    return got, asked


async def test_a_warm_waiter_overtakes_a_cold_one() -> None:
    """The cold request came first; the turns with less to compute go before it, the least
    first, and equals in their order of arrival. Each cost is asked once."""
    got, asked = await _served_order(
        SlotTable(1, overtakes=8), [("cold", 2300.0), ("warm-a", 80.0), ("warm-b", 20.0), ("warm-c", 80.0)]
    )
    assert got == ["warm-b", "warm-a", "warm-c", "cold"]
    assert asked == {"cold": 1, "warm-a": 1, "warm-b": 1, "warm-c": 1}


async def test_a_cold_waiter_is_overtaken_at_most_the_bound() -> None:
    """Two overtakes allowed: the cold request goes after two of the four warm turns that
    came after it, then the rest in their order."""
    got, _ = await _served_order(
        SlotTable(1, overtakes=2), [("cold", 2300.0), ("w1", 10.0), ("w2", 10.0), ("w3", 10.0), ("w4", 10.0)]
    )
    assert got == ["w1", "w2", "cold", "w3", "w4"]


async def test_the_bound_holds_for_every_waiter_in_line() -> None:
    """Two cold requests behind each other and a stream of cheaper ones: neither cold one is
    passed more than once (older ones reach the bound first), and the cheapest go first."""
    got, _ = await _served_order(
        SlotTable(1, overtakes=1),
        [("cold-1", 900.0), ("cold-2", 800.0), ("w1", 10.0), ("w2", 5.0), ("w3", 10.0)],
    )
    # w2 passes both; cold-1 is due; cold-2 (passed once) is due; then w2's equals in order.
    assert got == ["w2", "cold-1", "cold-2", "w1", "w3"]


async def test_no_overtakes_is_first_come_first_served() -> None:
    got, _ = await _served_order(SlotTable(1, overtakes=0), [("cold", 2300.0), ("warm", 1.0), ("warmer", 0.0)])
    assert got == ["cold", "warm", "warmer"]


async def test_a_cancelled_waiter_leaves_the_line_at_once() -> None:
    """Cancelled in the tick the slot frees: it is not granted (nothing leaks), and the next
    cheapest is; a request that finds a free slot is never asked its cost."""
    table = SlotTable(1, overtakes=8)
    holder = table.claim(0, "holder")
    got: list[str] = []
    scopes: dict[str, trio.CancelScope] = {}

    async def want(name: str, cost: float) -> None:
        with trio.CancelScope() as scopes[name]:
            await table.claim_any(name, lambda _i: (0,), lambda: cost)
            got.append(name)

    async with trio.open_nursery() as nursery:
        for name, cost in (("cold", 500.0), ("warm", 1.0)):
            nursery.start_soon(want, name, cost)
            await trio.testing.wait_all_tasks_blocked()
        scopes["warm"].cancel()
        assert table.waiting == 1
        table.release(holder)  # the same tick
    assert got == ["cold"] and table.slots[0].owner == "cold" and table.waiting == 0

    def never() -> float:
        raise AssertionError("a request that waits for nothing is not costed")

    table.release(table.slots[0])
    assert (await table.claim_any("free", lambda _i: (0,), never)).owner == "free"


async def _complete(h: Any, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
    r = await h.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


async def test_a_turn_back_from_ram_goes_before_a_full_prefill(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """One slot, a's history in RAM (b's turn took the slot): while the slot is held, a cold
    prompt starts waiting, then a's next turn; a's turn, which computes its 40 new tokens,
    gets the slot first. ``work_left`` is what orders them."""
    ep = await start_engine(tiny_model, slots=1, cache_ram_mib=64)
    core = ep.state.engine._core
    a, b, cold = SYSTEM + _tokens(1, 120), SYSTEM + _tokens(2, 120), _tokens(9, 400)
    async with http(ep) as h:
        await _complete(h, a)
        await _complete(h, b)  # a's history to RAM
        a_next = a + _tokens(3, 40)
        assert core.scheduler.work_left(a_next) == 40  # from RAM
        assert core.scheduler.work_left(b + _tokens(4, 40)) == 40  # from the slot
        assert core.scheduler.work_left(cold) == len(cold)
        assert core.scheduler.work_left(SYSTEM + _tokens(5, 100)) == 100  # the shared head
        done: list[str] = []
        async with trio.open_nursery() as nursery:

            async def turn(name: str, prompt: list[int]) -> None:
                await _complete(h, prompt)
                done.append(name)

            async with ep.state.engine.claim("test", slot=0):
                for name, prompt, n in (("cold", cold, 1), ("a", a_next, 2)):
                    nursery.start_soon(turn, name, prompt)
                    with trio.fail_after(30):
                        while core.slots.waiting < n:  # the request's HTTP round trip
                            await trio.testing.wait_all_tasks_blocked(cushion=0.01)
        assert done == ["a", "cold"]
