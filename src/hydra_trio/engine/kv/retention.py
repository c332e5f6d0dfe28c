"""What KV stays when room is needed: the one eviction order of the slots, the host prompt
cache (RAM) and the disk tier (--session-policy).

``session`` (the default) ranks a history by the agent session that owns it
(engine/sched/session_tree.py): first the finished ones (a subagent whose parent went on, a
session whose last turn said so), then one-off prompts (no session), then expired sessions
(no turn for their retention TTL), then live sessions, the lower priority first and, among
equals, the one whose next turn is expected last (Belady's rule, with the next use guessed):

- a parent that waits on subagents still working: its next turn comes after theirs (the
  disk tier keeps it, and their last turn brings it back: tiers.py ``want``), the most
  recent wait first;
- a session between turns (its tool runs): its latest turn's end plus its usual gap
  between turns (its own, else every session's); once idle past twice that, as long again
  as it has been idle (a session that stops coming back leaves before ones that keep time);
- a session whose turn runs: last.

Agents that take turns in a cycle larger than the cache are the case this is for: recency
(``lru``) drops the history whose turn comes next, and then the next one's. Within one
owner, the oldest copy goes first. ``lru`` ranks everything alike: least recently used
first, as before sessions existed.

Pure: no llama_cpp, no trio (the clock is given).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

POLICIES = ("session", "lru")
# Evictions are counted by the kind of history they dropped (metrics, benchmarks.agents).
FINISHED, ONE_OFF, EXPIRED, LIVE = "finished", "one_off", "expired", "live"
EVICTION_KINDS = (FINISHED, ONE_OFF, EXPIRED, LIVE)
TIERS = ("slot", "ram", "disk")


class KvOwner(Protocol):
    """A session as the eviction order sees it (``Session`` in engine/sched/session_tree.py)."""

    @property
    def seq(self) -> int: ...  # creation order: larger is younger

    @property
    def priority(self) -> int: ...

    @property
    def last_active(self) -> float: ...

    @property
    def salt(self) -> str | None: ...  # the cache_salt its histories were computed under

    def running(self) -> bool: ...  # a turn of its own runs

    def waiting(self) -> bool: ...  # on subagents that have not returned

    def usual_gap(self) -> tuple[float | None, float | None]: ...  # (its latest turn's end, its usual gap)

    def finished(self) -> bool: ...

    def expired(self, now: float) -> bool: ...


OwnerT = TypeVar("OwnerT", bound=KvOwner)


@dataclass(slots=True)
class Retention:
    policy: str  # one of POLICIES
    clock: Callable[[], float]  # trio.current_time in the engine
    evictions: Counter[tuple[str, str]] = field(default_factory=Counter)  # (tier, kind) -> count

    def kind(self, owner: KvOwner | None) -> str:
        if owner is None:
            return ONE_OFF
        if owner.finished():
            return FINISHED
        return EXPIRED if owner.expired(self.clock()) else LIVE

    def rank(self, owner: KvOwner | None) -> tuple[float, ...]:
        """Lower goes first. Equal for every owner under ``lru`` (recency decides alone)."""
        if self.policy == "lru":
            return ()
        kind = self.kind(owner)
        if owner is None:
            return (1.0,)
        if kind == FINISHED:
            return (0.0, owner.last_active)
        if kind == EXPIRED:
            return (2.0, owner.last_active)
        return (3.0, float(owner.priority), *self._next_turn(owner))

    def _next_turn(self, owner: KvOwner) -> tuple[float, float]:
        """A live session's place among equals: (0 waiting on subagents, 1 between turns, 2
        running; then minus when its next turn is expected: the latest first)."""
        if owner.running():
            return (2.0, 0.0)
        ended, gap = owner.usual_gap()
        if ended is None:
            return (1.0, -owner.last_active)
        if owner.waiting():
            return (0.0, -ended)
        now = self.clock()
        if gap is None:  # no session has shown its pace yet: the latest to end comes back last
            return (1.0, -ended)
        idle = now - ended
        return (1.0, -(ended + gap if idle <= 2 * gap else now + idle))

    def victim(self, owners: Iterable[OwnerT | None]) -> OwnerT | None:
        """The owner whose history goes first (ties: the first given, the oldest)."""
        return min(owners, key=self.rank)

    def evicted(self, tier: str, owner: KvOwner | None) -> None:
        self.evictions[(tier, self.kind(owner))] += 1

    def counts(self) -> tuple[tuple[str, str, int], ...]:
        """Evictions so far, as (tier, kind, count) (``EngineStats.evictions``)."""
        return tuple((tier, kind, n) for (tier, kind), n in sorted(self.evictions.items()))
