"""The worker-to-trio hand-over of step results (engine/handover.py)."""

from __future__ import annotations

import trio

from hydra_trio.engine.sched.handover import Handover


async def test_calls_sent_from_a_thread_run_on_trio_in_order() -> None:
    handover = Handover()
    got: list[int] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(handover.run)

            def send_many() -> None:
                for i in range(500):  # more wake-up bytes than one read takes
                    handover.send(got.append, i)

            await trio.to_thread.run_sync(send_many)
            handover.drain()  # what the run task has not run yet
            assert got == list(range(500))

            # Without drain: the run task wakes on the write and runs the call.
            woke = trio.Event()
            await trio.to_thread.run_sync(lambda: handover.send(woke.set))
            with trio.fail_after(10):
                await woke.wait()
            nursery.cancel_scope.cancel()
    finally:
        handover.close()
