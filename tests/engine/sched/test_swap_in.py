"""A turn whose history comes back from RAM into a slot that holds another's: one GPU-worker
call (the slot's history copied out, the entry restored, cut to the prompt), where it took
three, each waiting for the step in flight (benchmarks/agents.py's later turns); and a turn
that wants a history another turn is copying out of its slot waits for it to land in RAM
instead of recomputing it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trio.testing

from helpers import http

SYSTEM = [300 + i % 200 for i in range(300)]  # a shared head the prompt cache holds once (>= MIN_SHARED)


def _tokens(seed: int, n: int) -> list[int]:
    return [300 + (seed * 7919 + i * 104729) % 200 for i in range(n)]


async def _complete(h: Any, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
    r = await h.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def _count_bring_calls(core: Any) -> list[int]:
    """The GPU-worker calls of each ``scheduler.bring`` from now on, one entry a bring."""
    calls: list[int] = []
    bring = core.scheduler.bring

    async def counted(*args: Any, **kwargs: Any) -> Any:
        before = core.worker.calls
        try:
            return await bring(*args, **kwargs)
        finally:
            calls.append(core.worker.calls - before)

    core.scheduler.bring = counted
    return calls


async def test_a_history_back_from_ram_takes_one_worker_call(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model, slots=1, cache_ram_mib=64)
    core = ep.state.engine._core
    a = SYSTEM + _tokens(1, 120)
    b = SYSTEM + _tokens(2, 120)
    calls = _count_bring_calls(core)
    async with http(ep) as h:
        await _complete(h, a)  # the slot holds a's history, and 3 generated positions
        await _complete(h, b)  # a's history goes to RAM; the slot holds b's
        again = await _complete(h, a + _tokens(3, 40))  # a's back from RAM, b's to RAM, cut to a
        assert _cached(again) == len(a)
        assert calls[-1] == 1
        cache = core.prompt_cache
        held = sorted(len(snap.tokens) for _, snap in cache.items())
        assert held == [len(b) + 3]  # b's history (with its 3 generated positions) is in RAM
        back = await _complete(h, b + _tokens(4, 40))  # and comes back, whole
        assert _cached(back) == len(b)
        assert calls[-1] == 1


async def test_a_turn_waits_for_its_history_leaving_another_slot(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """Two slots: session a's history is in slot 0 when c's turn takes slot 0 to bring c's
    history back from RAM, and a's next turn comes while a's history is being copied out
    (neither in a free slot nor in RAM yet). a's turn waits for it to land and continues
    from it, rather than recompute it from the shared head in slot 1."""
    ep = await start_engine(tiny_model, slots=2, cache_ram_mib=64)
    core = ep.state.engine._core
    sched = core.scheduler
    a, b, c = (SYSTEM + _tokens(i, 150) for i in (1, 2, 3))
    async with http(ep) as h:
        first_c = await _complete(h, c)
        await _complete(h, b)
        await _complete(h, a)  # c's slot: c's history to RAM; slots now hold b's and a's
        slot_a = next(s for s in range(2) if core.backend.seq_tokens[s][: len(a)] == a)
        # b's slot (busy meanwhile) is not a's choice: a's turn must find its history in slot_a or RAM.
        held = core.slots.claim(1 - slot_a, "test")
        restore = sched._restore
        copying = trio.Event()
        go_on = trio.Event()

        async def slow_restore(*args: Any, **kwargs: Any) -> Any:
            copying.set()  # a's history is registered as leaving slot_a
            await go_on.wait()
            return await restore(*args, **kwargs)

        sched._restore = slow_restore
        results: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:

            async def turn(name: str, prompt: list[int]) -> None:
                results[name] = await _complete(h, prompt)

            nursery.start_soon(turn, "c", c + _tokens(5, 30))  # takes slot_a (the only free one)
            await copying.wait()
            sched._restore = restore
            core.slots.release(held)  # a free slot for a's turn: it holds b's history, not a's
            nursery.start_soon(turn, "a", a + _tokens(6, 30))
            with trio.fail_after(30):
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            assert sched._left.statistics().tasks_waiting == 1  # a's turn waits for the copy to land
            assert "a" not in results
            go_on.set()
        assert _cached(results["c"]) == len(c) == first_c["usage"]["prompt_tokens"]
        assert _cached(results["a"]) == len(a)  # continued from a's history, back from RAM


async def test_a_borrowed_history_stays_in_ram(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    """b's prompt shares a's head only: b's turn restores a copy of a's history, cut to the
    head, and a's entry stays in RAM (it is not taken and copied back), in one worker call."""
    ep = await start_engine(tiny_model, slots=1, cache_ram_mib=64)
    core = ep.state.engine._core
    a, b = SYSTEM + _tokens(1, 120), SYSTEM + _tokens(2, 120)
    calls = _count_bring_calls(core)
    async with http(ep) as h:
        await _complete(h, a)
        await _complete(h, _tokens(9, 100))  # a one-off prompt: a's history goes to RAM
        got = await _complete(h, b)
        assert _cached(got) == len(SYSTEM)  # a's head, borrowed
        assert calls[-1] == 1
        held = sorted(len(snap.tokens) for _, snap in core.prompt_cache.items())
        assert held == [100 + 3, len(a) + 3]  # the one-off's history, and a's still
