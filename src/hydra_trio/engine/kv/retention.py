"""What KV stays when room is needed: the one eviction order of the slots, the host prompt
cache (RAM) and the disk tier (--session-policy).

``session`` (the default) ranks a history by the agent session that owns it
(engine/sched/session_tree.py): first the finished ones (a subagent whose parent went on, a
session whose last turn said so), then one-off prompts (no session), then expired sessions
(no turn for their retention TTL), then live sessions, the lower priority first and, among
equals, the tree idle longest first (a tree is as recent as its latest turn: a parent that
waits on its subagents is not idle), and within a tree the member idle longest (a parent
waiting on subagents that work goes before them: their next turns come first; the disk tier
keeps it, and their last turn brings it back, tiers.py ``want``). Within one owner, the
oldest copy goes first. ``lru`` ranks everything
alike: least recently used first, as before sessions existed.

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

    def activity(self) -> tuple[float, float]: ...  # (its tree's latest activity, its own)

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
        tree_active, own = owner.activity()
        return (3.0, float(owner.priority), tree_active, own)

    def victim(self, owners: Iterable[OwnerT | None]) -> OwnerT | None:
        """The owner whose history goes first (ties: the first given, the oldest)."""
        return min(owners, key=self.rank)

    def evicted(self, tier: str, owner: KvOwner | None) -> None:
        self.evictions[(tier, self.kind(owner))] += 1

    def counts(self) -> tuple[tuple[str, str, int], ...]:
        """Evictions so far, as (tier, kind, count) (``EngineStats.evictions``)."""
        return tuple((tier, kind, n) for (tier, kind), n in sorted(self.evictions.items()))
