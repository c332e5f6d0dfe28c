"""Agent sessions as trees of turns (engine/sched/session_tree.py): keys scoped by tenant and
cache_salt, a tree cancelled as one, a deadline as a cancel scope's, ``finish``, and the
bounds of the table. No engine: the turns here are tasks that wait."""

from __future__ import annotations

from functools import partial

import pytest
import trio
import trio.testing

from hydra_trio.engine.sched import Session, SessionTree, Turn
from hydra_trio.engine.sched.session_tree import DEADLINE, FINISHED, GONE, PARENT
from hydra_trio.wire.agentic import SessionHint


def _hint(sid: str, parent: str | None = None, **kw: object) -> SessionHint:
    return SessionHint(sid, parent, blocks_parent=parent is not None, **kw)  # type: ignore[arg-type]


async def _run_turn(
    tree: SessionTree,
    hint: SessionHint | None,
    out: dict[str, Turn],
    name: str,
    *,
    tenant: str = "t",
    salt: str | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A request that waits for ever inside its turn (as a generation waits on its steps)."""
    async with tree.turn(tenant, salt, hint) as turn:
        out[name] = turn
        task_status.started()
        await trio.sleep_forever()


async def test_a_session_key_is_scoped_by_tenant_and_salt() -> None:
    tree = SessionTree(ttl_s=60)
    seen: list[Session | None] = []
    for tenant, salt in (("a", None), ("b", None), ("a", "salt-1"), ("a", None)):
        async with tree.turn(tenant, salt, _hint("s")) as turn:
            seen.append(turn.session)
    assert seen[0] is seen[3]  # the same tenant and salt: one session
    assert len({id(s) for s in seen}) == 3 and len(tree) == 3
    # Another tenant (or salt) finishing "s" finds its own or nothing, never a's.
    done = await tree.finish("b", None, "s")
    assert done.found and done.sessions == 1
    assert tree.get(("a", None, "s")) is seen[0] and not seen[0].released
    assert not (await tree.finish("c", None, "s")).found


async def test_a_parent_cancelled_from_outside_cancels_its_tree_at_once() -> None:
    tree = SessionTree(ttl_s=60)
    turns: dict[str, Turn] = {}
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as parent_scope:  # the parent's client connection
            async with trio.open_nursery() as parent_nursery:
                await parent_nursery.start(_run_turn, tree, _hint("root"), turns, "root")
                await nursery.start(_run_turn, tree, _hint("child", "root"), turns, "child")
                await nursery.start(_run_turn, tree, _hint("grandchild", "child"), turns, "grandchild")
                await nursery.start(_run_turn, tree, _hint("other"), turns, "other")
                # another tenant's "root"
                await nursery.start(partial(_run_turn, tree, _hint("root"), turns, "root-again", tenant="u"))
                parent_scope.cancel()
        # The cancellation reached both descendants before anything else ran: their turns
        # ended with the parent's, in the same pass of the scheduler.
        await trio.testing.wait_all_tasks_blocked()
        assert turns["root"].cut == GONE
        assert turns["child"].cut == PARENT and turns["child"].ended.is_set()
        assert turns["grandchild"].cut == PARENT and turns["grandchild"].ended.is_set()
        assert turns["other"].cut is None and not turns["other"].ended.is_set()
        assert turns["root-again"].cut is None
        nursery.cancel_scope.cancel()


async def test_a_deadline_cuts_the_turn_and_its_tree(autojump_clock: trio.testing.MockClock) -> None:
    tree = SessionTree(ttl_s=60)
    turns: dict[str, Turn] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(_run_turn, tree, _hint("child", "root"), turns, "child")
        t0 = trio.current_time()
        async with tree.turn("t", None, _hint("root", deadline_s=2.0)) as turn:
            await trio.sleep_forever()  # cut by its deadline: the block ends, no exception
        assert turn.cut == DEADLINE and trio.current_time() - t0 == pytest.approx(2.0)
        await trio.testing.wait_all_tasks_blocked()
        assert turns["child"].cut == PARENT and turns["child"].ended.is_set()
    assert tree.turns_cut == 2


async def test_finish_cancels_waits_and_releases_the_whole_tree() -> None:
    tree = SessionTree(ttl_s=60)
    released: list[set[Session]] = []

    async def release(owners: set[Session]) -> tuple[int, int, int]:
        # Called after every cancelled turn has ended: none of them is live any more.
        assert all(not s.turns for s in owners)
        released.append(owners)
        return 1, 2, 3

    tree.release = release
    turns: dict[str, Turn] = {}
    async with trio.open_nursery() as nursery:
        for name, parent in (("root", None), ("a", "root"), ("b", "root"), ("a1", "a")):
            await nursery.start(_run_turn, tree, _hint(name, parent), turns, name)
        await nursery.start(_run_turn, tree, _hint("solo"), turns, "solo")
        done = await tree.finish("t", None, "a")  # a subtree: a and a1
        assert (done.found, done.sessions, done.cancelled) == (True, 2, 2)
        assert (done.slots_cleared, done.ram_entries, done.disk_entries) == (1, 2, 3)
        assert {s.id for s in released[0]} == {"a", "a1"}
        assert turns["a"].cut == FINISHED and turns["a1"].cut == FINISHED
        assert turns["root"].cut is None and turns["b"].cut is None
        assert tree.get(("t", None, "a")) is None and tree.get(("t", None, "root")) is not None
        assert [c.id for c in tree.get(("t", None, "root")).children] == ["b"]  # type: ignore[union-attr]
        done = await tree.finish("t", None, "root")
        assert (done.sessions, done.cancelled) == (2, 2)
        assert not (await tree.finish("t", None, "root")).found  # idempotent
        assert len(tree) == 1  # "solo"
        nursery.cancel_scope.cancel()


async def test_a_parent_turn_marks_the_subagents_it_waited_on_done() -> None:
    tree = SessionTree(ttl_s=60)
    async with tree.turn("t", None, _hint("root")):
        pass
    async with tree.turn("t", None, _hint("sub", "root")) as sub:
        pass
    assert sub.session is not None and not sub.session.finished()
    async with tree.turn("t", None, _hint("root")):  # the parent resumes: its subagent returned
        pass
    assert sub.session.done and sub.session.finished()
    async with tree.turn("t", None, _hint("sub", "root")):  # named again: live again
        assert not sub.session.done
    async with tree.turn("t", None, _hint("last", expected_resume=False)) as last:
        pass
    assert last.session is not None and last.session.done


async def test_the_table_is_bounded_and_forgets_idle_trees(autojump_clock: trio.testing.MockClock) -> None:
    tree = SessionTree(ttl_s=10, max_sessions=2)
    for name in ("a", "b"):
        async with tree.turn("t", None, _hint(name)):
            pass
    async with tree.turn("t", None, _hint("c")) as full:
        assert full.session is None  # no room, nothing idle: served as a one-off request
    await trio.sleep(11)
    async with tree.turn("t", None, _hint("c")) as later:
        assert later.session is not None  # the idle ones were forgotten to make room
    assert len(tree) == 1
    kept = later.session
    await trio.sleep(11)
    assert kept.expired(trio.current_time())
    assert tree.sweep(trio.current_time()) == 1 and len(tree) == 0


async def test_no_parent_chain_makes_a_cycle() -> None:
    tree = SessionTree(ttl_s=60)
    async with tree.turn("t", None, _hint("a", "b")) as a:
        pass
    async with tree.turn("t", None, _hint("b", "a")) as b:
        pass
    assert a.session is not None and b.session is not None
    assert a.session.parent is b.session and b.session.parent is None


async def test_a_session_keeps_its_pace_and_a_waiting_parent_is_known(autojump_clock: trio.testing.MockClock) -> None:
    """The gap between a turn's end and the session's next is its pace (every session's for
    one that has none yet), except a wait on its subagents; a parent is waiting while a
    subagent that blocks it has not returned (the retention order reads these)."""
    tree = SessionTree(ttl_s=600)
    async with tree.turn("t", None, _hint("lead")) as turn:
        lead = turn.session
    assert lead is not None and lead.usual_gap() == (trio.current_time(), None) and not lead.running()
    await trio.sleep(2)
    async with tree.turn("t", None, _hint("lead")):
        assert lead.running()
    assert lead.gap_s == pytest.approx(2) and tree.pace.gap_s == pytest.approx(2)
    await trio.sleep(4)
    async with tree.turn("t", None, _hint("lead")):
        pass
    assert lead.gap_s == pytest.approx(2 + 0.3 * (4 - 2))
    # A subagent's first turn: the parent waits until its own next turn.
    async with tree.turn("t", None, _hint("sub", "lead")) as turn:
        sub = turn.session
    # the sub has no pace of its own
    assert sub is not None and lead.waiting() and sub.usual_gap()[1] == tree.pace.gap_s
    await trio.sleep(30)
    async with tree.turn("t", None, _hint("lead")):
        pass
    assert not lead.waiting() and sub.done
    assert lead.gap_s == pytest.approx(2.6)  # the 30 s wait was not its pace
