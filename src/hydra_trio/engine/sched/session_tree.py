"""Agent sessions: who a request's KV belongs to, the trees sessions form, and the cancel
scope of every turn, so that a tree is cancelled as one.

A session is named by the client (wire/agentic.py) and scoped here by the caller's tenant
(its API key) and cache_salt: the key is ``(tenant, salt, id)``, so one tenant naming
another's session id names a session of its own, and can neither pin, read, release nor
time the other's. A session's parent is of the same tenant and salt.

Every request runs in a ``Turn``: a cancel scope (its deadline is the request's
``deadline_seconds``) registered with its session while it lives. A turn that ends
cancelled (the client left, DELETE, its deadline, ``finish``) cancels the live turns of
every descendant session at once: what trio does for a nursery's children, done for
requests that arrive on their own connections. ``finish`` ends a session's whole tree:
its live turns are cancelled, waited for, and its KV released (``release``, the
scheduler's). The eviction order reads a session through ``KvOwner`` (kv/retention.py).

Bounded: at most ``max_sessions`` records; a record whose tree has had no turn for its TTL
is forgotten by ``sweep`` (KV it owns keeps its rank: expired).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from itertools import count

import trio

from ...wire.agentic import SessionHint

log = logging.getLogger(__name__)

SessionKey = tuple[str, str | None, str]  # (tenant, cache_salt, session id)
MAX_DEPTH = 64  # a parent chain longer than this is not linked
FINISH_WAIT_S = 10.0  # cancelled turns end within a step; this bounds the wait regardless

# Why a turn was cut (its receipt's ``cut``).
DEADLINE, FINISHED, PARENT, GONE = "deadline", "finish_session", "parent_cancelled", "cancelled"
PACE_WEIGHT = 0.3  # of the latest gap between turns in a session's usual one (an EWMA)


@dataclass(slots=True)
class Pace:
    """The usual gap between one turn's end and the next turn of the same session (its tool's
    run, a human's reading): every session's, for a session that has not shown its own yet."""

    gap_s: float | None = None

    def saw(self, gap: float) -> None:
        self.gap_s = gap if self.gap_s is None else self.gap_s + PACE_WEIGHT * (gap - self.gap_s)


@dataclass(eq=False, slots=True)
class Session:
    key: SessionKey
    seq: int  # creation order
    ttl_s: float
    last_active: float  # its own latest turn (begun or ended)
    tree_active: float  # the latest turn of it or of a descendant: when its tree was last active
    parent: Session | None = None
    children: list[Session] = field(default_factory=list)
    turns: set[Turn] = field(default_factory=set)  # live requests
    priority: int = 0
    released: bool = False  # finish_session: its KV is dropped
    done: bool = False  # a finished subagent (its parent went on) or a last turn: evicted first
    blocks_parent: bool = False
    ended: float | None = None  # when its latest turn ended (None: none has)
    gap_s: float | None = None  # its own usual gap between turns (None: not seen yet)
    pace: Pace | None = None  # every session's (its tree's table), for when it has none of its own

    @property
    def id(self) -> str:
        return self.key[2]

    @property
    def salt(self) -> str | None:
        return self.key[1]

    def finished(self) -> bool:
        return self.released or self.done

    def live(self) -> bool:
        """A turn of this session or of a descendant is running."""
        return bool(self.turns) or any(c.live() for c in self.children)

    def expired(self, now: float) -> bool:
        """No turn of its tree for its TTL (a parent that waits on its subagents is not idle)."""
        return not self.live() and now > self.tree_active + self.ttl_s

    def activity(self) -> tuple[float, float]:
        """(its tree's latest activity, its own): what the retention order ranks a live
        session by."""
        root = self
        while root.parent is not None:
            root = root.parent
        return root.tree_active, self.last_active

    def running(self) -> bool:
        """A turn of its own is running (its KV is in a slot, in use)."""
        return bool(self.turns)

    def waiting(self) -> bool:
        """It waits on subagents that have not returned: its next turn comes after theirs."""
        return any(c.blocks_parent and not c.finished() for c in self.children)

    def usual_gap(self) -> tuple[float | None, float | None]:
        """(when its latest turn ended, its usual gap before the next: its own, else every
        session's; None: unknown), what the retention order expects its next turn from."""
        gap = self.gap_s if self.gap_s is not None else self.pace.gap_s if self.pace is not None else None
        return self.ended, gap

    def began(self, now: float) -> None:
        """A turn of its own begins: the gap since its last one is its pace, unless it waited on
        subagents meanwhile (they have not returned, or its tree had a turn since: that wait
        is not its pace)."""
        if self.ended is None or self.turns or self.tree_active > self.ended or self.waiting():
            return
        gap = now - self.ended
        self.gap_s = gap if self.gap_s is None else self.gap_s + PACE_WEIGHT * (gap - self.gap_s)
        if self.pace is not None:
            self.pace.saw(gap)

    def subtree(self) -> list[Session]:
        out, todo = [], [self]
        while todo:
            s = todo.pop()
            out.append(s)
            todo.extend(s.children)
        return out

    def touch(self, now: float) -> None:
        """A turn began or ended: the session is active, and so is the tree of every ancestor
        (a parent that waits on its subagents is not idle)."""
        self.last_active = max(self.last_active, now)
        s: Session | None = self
        while s is not None:
            s.tree_active = max(s.tree_active, now)
            s = s.parent


@dataclass(eq=False, slots=True)
class Turn:
    """One request's life in its session (None: a one-off request)."""

    session: Session | None
    hint: SessionHint | None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    cut: str | None = None  # why its scope cancelled it (DEADLINE, FINISHED, PARENT) or GONE
    ended: trio.Event = field(default_factory=trio.Event)

    @property
    def session_id(self) -> str | None:
        return None if self.session is None else self.session.id

    @property
    def cause(self) -> str | None:
        """Why its scope cancelled it so far (None: it did not)."""
        return self.cut or (DEADLINE if self.scope.cancel_called else None)

    def cancel(self, why: str) -> None:
        if self.cut is None:
            self.cut = why
        self.scope.cancel()

    def cancel_subagents(self) -> None:
        """Cancel the live turns of every descendant session (the request was stopped by a
        scope of its own caller's, e.g. DELETE: its tree ends with it)."""
        if self.session is not None:
            cancel_below(self.session)


def cancel_below(session: Session) -> None:
    """Cancel every live turn of the session's descendants (not its own): at once, so each
    stops at its next checkpoint, within one step of the batch it is in."""
    for child in session.children:
        for s in child.subtree():
            for turn in list(s.turns):
                turn.cancel(PARENT)


@dataclass(frozen=True, slots=True)
class SessionStats:
    """The session table's figures at one moment (``EngineStats.sessions``)."""

    sessions: int  # records held
    live_turns: int  # requests running in a session
    turns_cut: int  # turns their own scope cut (deadline, finish, parent cancelled)
    trees_finished: int  # finish calls that found their session


@dataclass(frozen=True, slots=True)
class Finished:
    """What ``finish`` did: sessions released, live requests cancelled, KV dropped."""

    found: bool
    sessions: int = 0
    cancelled: int = 0
    slots_cleared: int = 0
    ram_entries: int = 0
    disk_entries: int = 0


Release = Callable[[set[Session]], Awaitable[tuple[int, int, int]]]  # -> slots, RAM entries, disk entries


class SessionTree:
    def __init__(
        self, *, ttl_s: float, max_sessions: int = 65536, release: Release | None = None,
        resuming: Callable[[Session], None] | None = None,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._sessions: dict[SessionKey, Session] = {}
        self._seq = count()
        self.pace = Pace()  # every session's usual gap between turns (the retention order's)
        self.release = release  # the engine's: drops a set of sessions' KV in every tier
        # The engine's prefetch (kv/tiers.py ``want``): told of a session that resumes soon,
        # as its client says (a subagent's last turn, or a turn that expects its next).
        self.resuming = resuming
        self.turns_cut = 0
        self.trees_finished = 0
        # Turns with a deadline, soonest first: ``run`` cuts each with its tree the moment it
        # passes (the scope's own deadline would reach the descendants only once the turn has
        # waited out its step in flight).
        self._deadlines: list[tuple[float, int, Turn]] = []
        self._order = count()
        self._sooner = trio.Event()
        self._timed = 0  # live turns in the heap (the rest ended: pruned when they dominate)

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, key: SessionKey) -> Session | None:
        return self._sessions.get(key)

    # ---- a request's turn ------------------------------------------------------------------

    @asynccontextmanager
    async def turn(self, tenant: str, salt: str | None, hint: SessionHint | None) -> AsyncIterator[Turn]:
        """Run the block as one turn of ``hint``'s session (None: a one-off request). The
        block ends early, without an exception, when the turn is cut (``Turn.cut``); a
        cancellation from outside (the client left) passes through, and both cancel the
        descendants' live turns first."""
        now = trio.current_time()
        session = None if hint is None else self._join(tenant, salt, hint, now)
        turn = Turn(session, hint)
        if hint is not None and hint.deadline_s is not None:
            turn.scope.deadline = now + hint.deadline_s
            if not self._deadlines or turn.scope.deadline < self._deadlines[0][0]:
                self._sooner.set()
            heapq.heappush(self._deadlines, (turn.scope.deadline, next(self._order), turn))
            self._timed += 1
        if session is not None:
            session.turns.add(turn)
            session.done = False
        cancelled = False
        try:
            with turn.scope:
                yield turn
        except trio.Cancelled:
            cancelled = True
            turn.cut = turn.cause or GONE
            raise
        finally:
            if turn.scope.cancelled_caught:
                cancelled = True
                turn.cut = turn.cause or DEADLINE
                self.turns_cut += 1
            if hint is not None and hint.deadline_s is not None:
                self._timed -= 1
                if len(self._deadlines) > 2 * self._timed + 64:  # bounded by the live turns
                    self._deadlines = [e for e in self._deadlines if not e[2].ended.is_set() and e[2] is not turn]
                    heapq.heapify(self._deadlines)
            if session is not None:
                session.turns.discard(turn)
                session.ended = trio.current_time()
                session.touch(session.ended)
                if hint is not None and hint.expected_resume is False:
                    session.done = True
                    if self.resuming is not None and session.blocks_parent and session.parent is not None:
                        self.resuming(session.parent)  # it returns to the parent that waits on it
                elif hint is not None and hint.expected_resume and self.resuming is not None:
                    self.resuming(session)  # its next turn comes once its tool has run
                if cancelled:
                    cancel_below(session)
            turn.ended.set()

    def _join(self, tenant: str, salt: str | None, hint: SessionHint, now: float) -> Session | None:
        key = (tenant, salt, hint.session_id)
        session = self._sessions.get(key)
        if session is None:
            session = self._create(key, now, hint.ttl_s)
            if session is None:
                return None
        elif session.released:  # a finished session named again starts anew
            session.released = False
        if hint.ttl_s is not None:
            session.ttl_s = hint.ttl_s
        session.priority = hint.priority
        session.blocks_parent = hint.blocks_parent
        if hint.parent_id is not None and session.parent is None:
            self._link(session, (tenant, salt, hint.parent_id), now)
        session.began(now)
        # A turn of a parent means the subagents it waited on have returned.
        for child in session.children:
            if child.blocks_parent and not child.live():
                child.done = True
        session.touch(now)
        return session

    def _create(self, key: SessionKey, now: float, ttl_s: float | None) -> Session | None:
        if len(self._sessions) >= self.max_sessions:
            self.sweep(now)
        if len(self._sessions) >= self.max_sessions:
            log.warning("session table full (%d): %r served as a one-off request", self.max_sessions, key[2])
            return None
        session = Session(key, next(self._seq), self.ttl_s if ttl_s is None else ttl_s, now, now, pace=self.pace)
        self._sessions[key] = session
        return session

    def _link(self, session: Session, parent_key: SessionKey, now: float) -> None:
        parent = self._sessions.get(parent_key) or self._create(parent_key, now, None)
        if parent is None:
            return
        depth, up = 0, parent
        while up is not None:  # no cycles, no endless chains
            if up is session or depth >= MAX_DEPTH:
                return
            up, depth = up.parent, depth + 1
        session.parent = parent
        parent.children.append(session)

    # ---- finishing a tree -------------------------------------------------------------------

    async def finish(self, tenant: str, salt: str | None, session_id: str) -> Finished:
        """End the session's tree: cancel its live turns, wait until they have ended (each
        within a step), release its KV everywhere, forget its records. Idempotent: a session
        that is not (or no longer) there is ``found=False``."""
        session = self._sessions.get((tenant, salt, session_id))
        if session is None:
            return Finished(False)
        tree = session.subtree()
        turns = [t for s in tree for t in s.turns]
        for s in tree:
            s.released = True
        for turn in turns:
            turn.cancel(FINISHED)
        with trio.move_on_after(FINISH_WAIT_S):
            for turn in turns:
                await turn.ended.wait()
        if session.parent is not None:
            session.parent.children.remove(session)
            session.parent = None
        for s in tree:
            self._sessions.pop(s.key, None)
            s.children.clear()
        slots = ram = disk = 0
        if self.release is not None:
            slots, ram, disk = await self.release(set(tree))
        self.trees_finished += 1
        return Finished(True, len(tree), len(turns), slots, ram, disk)

    # ---- bounds -----------------------------------------------------------------------------

    def sweep(self, now: float) -> int:
        """Forget the records of sessions whose tree is idle past its TTL, leaves first (KV
        they own keeps them alive as objects, ranked expired). Returns how many."""
        gone = 0
        for key, s in list(self._sessions.items()):
            if s.children or s.live() or now <= s.tree_active + s.ttl_s:
                continue
            if s.parent is not None:
                s.parent.children.remove(s)
                s.parent = None
            del self._sessions[key]
            gone += 1
        return gone

    async def run(self) -> None:
        """Cut turns whose deadline passed, with their trees, at once; forget idle records now
        and then (also done when the table is full), so an idle engine's table shrinks back."""
        period = max(1.0, min(60.0, self.ttl_s / 2))
        next_sweep = trio.current_time() + period
        while True:
            now = trio.current_time()
            while self._deadlines and self._deadlines[0][0] <= now:
                _, _, turn = heapq.heappop(self._deadlines)
                if not turn.ended.is_set():
                    turn.cancel(DEADLINE)
                    turn.cancel_subagents()
            if now >= next_sweep:
                self.sweep(now)
                next_sweep = now + period
            wake = min(next_sweep, self._deadlines[0][0] if self._deadlines else next_sweep)
            self._sooner = trio.Event()
            with trio.move_on_at(wake):
                await self._sooner.wait()

    def stats(self) -> SessionStats:
        live = sum(len(s.turns) for s in self._sessions.values())
        return SessionStats(len(self._sessions), live, self.turns_cut, self.trees_finished)


@dataclass(frozen=True, slots=True)
class TenantSessions:
    """One tenant's agent sessions (``Engine.sessions``): its turns and its ``finish``. Every
    key it makes carries its tenant, so another tenant's sessions are out of its reach."""

    tree: SessionTree
    tenant: str

    def turn(self, hint: SessionHint | None, salt: str | None) -> AbstractAsyncContextManager[Turn]:
        """A request's turn (``SessionTree.turn``): ``async with sessions.turn(...) as turn``."""
        return self.tree.turn(self.tenant, salt, hint)

    async def finish(self, session_id: str, salt: str | None) -> Finished:
        """vllm-router's ``POST /finish_session``: the session's tree ends, its KV released."""
        return await self.tree.finish(self.tenant, salt, session_id)
