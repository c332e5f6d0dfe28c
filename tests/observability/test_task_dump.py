"""What runs now, for a hang (observability/task_dump.py): the trio task tree with the line
each task waits on, tasks alike counted, every thread's stack, and a bound on the lines."""

from __future__ import annotations

import threading

import trio
import trio.testing

from hydra_trio.observability import dump_lines


async def _idle_connection() -> None:
    await trio.sleep_forever()


async def test_the_tree_says_where_each_task_waits_and_counts_tasks_alike() -> None:
    release = threading.Event()
    waiting, in_thread = trio.Event(), trio.Event()

    def blocked_call() -> None:  # as the GPU worker in a llama.cpp call
        trio.from_thread.run_sync(in_thread.set)
        release.wait()

    async def claim_a_slot() -> None:
        await waiting.wait()

    async def handler() -> None:
        async with trio.open_nursery() as inner:
            inner.start_soon(claim_a_slot)
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        for _ in range(40):
            nursery.start_soon(_idle_connection)
        nursery.start_soon(handler)
        nursery.start_soon(trio.to_thread.run_sync, blocked_call)
        await in_thread.wait()
        await trio.testing.wait_all_tasks_blocked()
        lines = dump_lines()
        release.set()
        nursery.cancel_scope.cancel()
    assert lines[0] == "trio tasks:"
    # 40 idle tasks alike: one line with their count, at the line they wait on, and what of trio's.
    (idle,) = [ln for ln in lines if "_idle_connection" in ln]
    assert idle.endswith("x40") and "test_task_dump.py:" in idle and "-> sleep_forever" in idle
    # A nursery's tasks sit under its task, one level deeper.
    (handler_line,) = [ln for ln in lines if ln.strip().startswith(f"{__name__}.test_the_tree") and "handler" in ln]
    (claim_line,) = [ln for ln in lines if "claim_a_slot" in ln]
    indent = len(handler_line) - len(handler_line.lstrip())
    assert len(claim_line) - len(claim_line.lstrip()) == indent + 2 and "-> wait" in claim_line
    # The thread in its blocking call is there with its stack, down to the call.
    (call,) = [ln for ln in lines if ln.endswith(" in blocked_call")]
    assert "test_task_dump.py:" in call


async def test_the_dump_is_bounded() -> None:
    async with trio.open_nursery() as nursery:
        for i in range(300):  # not alike: each its own name
            nursery.start_soon(_idle_connection, name=f"conn-{i}")
        await trio.testing.wait_all_tasks_blocked()
        lines = dump_lines(max_lines=50)
        nursery.cancel_scope.cancel()
    assert len(lines) == 50 and lines[-1].startswith("... ") and lines[-1].endswith("more lines left out")
    assert int(lines[-1].split()[1]) > 250
