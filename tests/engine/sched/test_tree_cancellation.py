"""A thousand cancelled session trees leave nothing held (issue 52): each tree is a parent and
two subagents generating at once, cut every way a tree is cut (the parent's client leaves,
its deadline passes, ``finish``), then finished. After them: no slot claimed, no turn live,
no session record, no payload budget, no shared-memory file, no temporary disk file, and no
task left behind."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trio.testing

from hydra_trio.observability import trio_task_count
from hydra_trio.wire.agentic import SessionHint

TREES = int(os.environ.get("HYDRA_TEST_TREES", "1000"))
CAUSES = ("client", "deadline", "finish")


async def test_a_thousand_cancelled_trees_leave_nothing_held(
    start_engine: Callable[..., Any], tiny_model: Path, tmp_path: Path
) -> None:
    shm, disk = tmp_path / "shm", tmp_path / "kv"
    shm.mkdir()
    ep = await start_engine(
        tiny_model, slots=3, cache_ram_mib=1, cache_disk=str(disk), kv_shm_dir=str(shm), log_requests=False,
    )
    engine = ep.state.engine
    tasks_before = trio_task_count()
    cut: dict[str, int] = {}

    async def generate(
        tenant: str, hint: SessionHint, prompt: str, started: trio.Event, scope: trio.CancelScope
    ) -> None:
        prepared = await engine.prepare("completions", {"prompt": prompt, "max_tokens": 200, "ignore_eos": True})

        async def emit(_text: str) -> None:
            started.set()

        with scope:
            async with engine.sessions(tenant).turn(hint, None) as turn:
                async with engine.claim(hint.session_id, prompt=prepared.tokens, turn=turn) as lease:
                    await lease.generate(prepared.tokens, prepared.params, emit)
            cut[turn.cut or "none"] = cut.get(turn.cut or "none", 0) + 1
        started.set()  # (a turn cut before its first token)

    for i in range(TREES):
        cause = CAUSES[i % len(CAUSES)]
        root = f"tree-{i}"
        deadline = 0.005 if cause == "deadline" else None
        hints = [
            SessionHint(root, deadline_s=deadline),
            SessionHint(f"{root}:a", root, blocks_parent=True),
            SessionHint(f"{root}:b", f"{root}:a", blocks_parent=True),
        ]
        started = [trio.Event() for _ in hints]
        scopes = [trio.CancelScope() for _ in hints]
        async with trio.open_nursery() as nursery:
            for hint, event, scope in zip(hints, started, scopes, strict=True):
                nursery.start_soon(generate, "t", hint, f"{hint.session_id} works on item {i} " * 3, event, scope)
            for event in started:
                await event.wait()
            if cause == "client":
                scopes[0].cancel()  # the parent's connection closed
            elif cause == "finish":
                await engine.sessions("t").finish(root, None)
            # a deadline cuts by itself
        if cause != "finish":
            done = await engine.sessions("t").finish(root, None)  # the end of the tree
            assert done.found and done.cancelled == 0  # nothing of it was still running
    stats = engine.stats()
    assert stats.slots_busy == 0 and stats.requests_waiting == 0
    assert stats.sessions is not None and stats.sessions.sessions == 0 and stats.sessions.live_turns == 0
    assert cut.get("parent_cancelled", 0) >= 2 * (TREES // len(CAUSES))  # every subagent of a cut parent
    assert ep.state.payload_budget.used == 0
    assert os.listdir(shm) == [] or all(not name.endswith(".kv") for name in os.listdir(shm))
    assert not any(name.startswith(".tmp-") for name in os.listdir(disk))
    await trio.testing.wait_all_tasks_blocked(cushion=0.05)
    assert trio_task_count() <= tasks_before  # no task left behind
