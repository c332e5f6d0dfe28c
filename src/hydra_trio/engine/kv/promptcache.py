"""The host-memory prompt cache: slots' KV kept past the slots (llama-server's --cache-ram).

When a slot is about to drop a history it holds (a new prompt shares little with it), the
engine copies the slot's state here first; when a prompt arrives whose prefix a cached
entry holds better than any slot, the entry goes back into the slot it gets. Entries are
snapshots as the backend reads them (``LlamaBackend.snapshot``: the state in this context's
own form with room before it, and the tail logits when the slot had them), so a swap back
is one restore and no copy. Bounded by bytes, least recently used out first.

An entry is a history under one cache_salt and one LoRA adapter set, and only a prompt under
the same salt and set continues it (``LlamaBackend.shared_prefix`` is the rule for slots; here
the salt and the set lead the order, so that each one's entries form their own run and a
lookup never crosses into another's).

Entries are also kept sorted by their tokens, so that a lookup costs a binary search and
two comparisons however many entries there are: the entry sharing the longest prefix with
a prompt is next to the prompt's place in that order. A scan of every entry per request
was the trio thread's main cost once the cache held a few thousand histories (the default
8 GiB holds hundreds of thousands of a small model's).

Which entry leaves for room is the retention order's (retention.py: by the owning agent
session, or least recently put first under ``--session-policy lru``); an entry evicted for
room goes to ``spill`` (the disk tier) when there is one.

Histories that start alike hold their first positions once (``_Head``): agents' sessions and
their subagents open with the same system prompt and tools, thousands of tokens that every
entry would otherwise hold again (16 histories of a replayed agent trace held 32k copies of a
2,000-token prompt in 43k positions: benchmarks/agents.py). A put that shares at least
``MIN_SHARED`` positions with an entry (the lookup a prompt makes) splits both at the shared
prefix (``Snapshot.split``: the first KV cache's cells below it) and keeps that head once,
counted in the bytes once, for as long as an entry uses it; ``take`` and a spill join an
entry to its head again (one copy). A state that does not split (a recurrent one, one whose
first cache is a window) is kept whole, as before.

Pure: no llama_cpp import; the engine does the GPU-worker calls.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import count
from typing import Any, Protocol

from ..llama import LoraSet, Snapshot, common_prefix_len
from .retention import KvOwner, Retention


@dataclass(frozen=True, slots=True)
class PromptCacheStats:
    """The prompt cache's figures at one moment (``EngineStats.prompt_cache``)."""

    nbytes: int
    entries: int
    saved: int
    restored: int
    restored_tokens: int
    evicted: int
    shared_bytes: int = 0  # of nbytes: heads held once for the entries that start alike
    heads: int = 0


@dataclass(frozen=True, slots=True)
class CacheHit:
    key: int
    n_common: int  # prompt tokens the entry holds
    n_tokens: int  # positions the entry holds in all
    checkpoint_at: int | None = None  # positions of its context checkpoint (Snapshot.checkpoint)


class CacheWatcher(Protocol):
    """Told each entry that comes and goes (blocks.HostBlocks: KV events of medium CPU)."""

    def entry_stored(
        self, key: int, tokens: Sequence[int], salt: str | None, lora: LoraSet = (), session_id: str | None = None
    ) -> None: ...
    def entry_removed(self, key: int) -> None: ...
    def cleared(self) -> None: ...


Spill = Callable[[Any, KvOwner | None], None]

# The fewest positions two histories share for their head to be held once: below it a split
# saves less than the copies it costs.
MIN_SHARED = 256


@dataclass(slots=True)
class _Head:
    """The first positions of histories that start alike, held once for the entries that use it."""

    n_tokens: int
    state: bytes  # Snapshot.split's head: the first KV cache's cells below n_tokens
    users: int = 0  # entries (and a put in progress) that need it

    @property
    def nbytes(self) -> int:
        return len(self.state)


@dataclass(slots=True)
class PromptCache:
    max_bytes: int
    retention: Retention | None = None  # None: least recently put first
    tier: str = "ram"  # what evictions are counted as (retention.evicted)
    _entries: OrderedDict[int, Snapshot] = field(default_factory=OrderedDict)  # least recently put first
    _sorted: list[int] = field(default_factory=list)  # the keys, ordered by their entries' tokens
    _keys: count[int] = field(default_factory=count)
    _owner: dict[int, KvOwner | None] = field(default_factory=dict)  # key -> the session it is
    _by_owner: dict[KvOwner | None, dict[int, None]] = field(default_factory=dict)  # each owner's keys, oldest first
    nbytes: int = 0
    saved: int = 0  # entries put here
    restored: int = 0  # entries taken back into a slot
    restored_tokens: int = 0  # their positions: prompt tokens not recomputed
    evicted: int = 0  # entries dropped for room (or replaced by a longer one)
    watcher: CacheWatcher | None = None
    spill: Spill | None = None  # takes what is evicted for room (the disk tier)
    min_shared: int = MIN_SHARED  # 0: every entry whole
    _head: dict[int, _Head] = field(default_factory=dict)  # key -> the head its entry continues
    shared: int = 0  # puts that held their first positions in a head shared with another entry

    def watch(self, watcher: CacheWatcher) -> None:
        """Tell ``watcher`` every entry held now, and from now on each change."""
        self.watcher = watcher
        for key, snap in self._entries.items():
            watcher.entry_stored(key, snap.tokens, snap.salt, snap.lora)

    def items(self) -> Iterator[tuple[int, Snapshot]]:
        return iter(self._entries.items())

    def stats(self) -> PromptCacheStats:
        heads = {id(h): h for h in self._head.values()}
        return PromptCacheStats(
            self.nbytes, len(self), self.saved, self.restored, self.restored_tokens, self.evicted,
            sum(h.nbytes for h in heads.values()), len(heads),
        )

    def __len__(self) -> int:
        return len(self._entries)

    def _order_of(self, key: int) -> tuple[str, LoraSet, list[int]]:
        return self._entries[key].order

    def put(self, snap: Snapshot, owner: KvOwner | None = None) -> bool:
        """Keep a snapshot of ``owner``'s history, evicting by the retention order for room;
        False when it alone is larger than the cache. An entry it extends (a prefix of its
        tokens) is dropped: the new one serves every prompt the old one did."""
        if snap.nbytes > self.max_bytes or not snap.tokens:
            return False
        # The heads of the entries it extends are its own first positions: kept through
        # their drop for it to share.
        held = [h for k in self._prefixes_of(snap.tokens, snap.salt, snap.lora) if (h := self._drop(k)) is not None]
        stored, head = self._share(snap, held)
        for h in held:
            self._let_go(h)
        while self._entries and self.nbytes + stored.nbytes > self.max_bytes:
            self._evict(self._victim())
        if self.nbytes + stored.nbytes > self.max_bytes:  # its head alone left no room
            if head is not None:
                self._let_go(head)
            return False
        key = next(self._keys)
        self._entries[key] = stored
        if head is not None:
            self._head[key] = head
        self._owner[key] = owner
        self._by_owner.setdefault(owner, {})[key] = None
        insort(self._sorted, key, key=self._order_of)
        self.nbytes += stored.nbytes
        self.saved += 1
        if self.watcher is not None:
            self.watcher.entry_stored(key, snap.tokens, snap.salt, snap.lora, getattr(owner, "id", None))
        return True

    def _share(self, snap: Snapshot, held: list[_Head]) -> tuple[Snapshot, _Head | None]:
        """What ``put`` keeps of ``snap``: itself, or its positions past a head it shares,
        with that head (taken for it: ``users``). The head is one it extends (``held``), or
        that of the entry it shares the most with when that head starts it, or, when that
        entry has none, a new one at the prefix they share: that entry is kept past it too."""
        if self.min_shared <= 0 or getattr(snap, "shape", None) is None:
            return snap, None
        n_snap = len(snap.tokens)
        candidates = [h for h in held if self.min_shared <= h.n_tokens < n_snap]
        hit = self.best(snap.tokens, snap.salt, snap.lora)
        if hit is not None and hit.n_common >= self.min_shared:
            other = self._head.get(hit.key)
            if other is not None and other.n_tokens <= hit.n_common and other.n_tokens < n_snap:
                candidates.append(other)
            elif other is None and not candidates:
                return self._share_new(snap, hit)
        if not candidates:
            return snap, None
        head = max(candidates, key=lambda h: h.n_tokens)
        parts = snap.split(head.n_tokens)
        if parts is None:
            return snap, None
        head.users += 1
        self.shared += 1
        return parts[1], head

    def _share_new(self, snap: Snapshot, hit: CacheHit) -> tuple[Snapshot, _Head | None]:
        """A head of the prefix ``snap`` shares with the whole entry ``hit``: both kept past it."""
        n = min(hit.n_common, len(snap.tokens) - 1, hit.n_tokens - 1)
        mine = snap.split(n)
        entry = self._entries[hit.key]
        theirs = entry.split(n) if mine is not None and isinstance(entry, Snapshot) else None
        if mine is None or theirs is None:
            return snap, None
        head = _Head(n, mine[0], users=2)  # that entry's, and the put's
        self._entries[hit.key] = theirs[1]
        self._head[hit.key] = head
        self.nbytes += head.nbytes + theirs[1].nbytes - entry.nbytes
        self.shared += 2
        return mine[1], head

    def _let_go(self, head: _Head) -> None:
        head.users -= 1
        if head.users == 0:
            self.nbytes -= head.nbytes

    def _whole(self, key: int) -> Snapshot:
        """The entry as a slot restores it (joined to its head when it has one)."""
        snap = self._entries[key]
        head = self._head.get(key)
        return snap if head is None else snap.joined(head.state)

    def _victim(self) -> int:
        """The entry that leaves first: of the owner the retention order ranks lowest, its
        oldest (under lru, or without one: the least recently put of all)."""
        if self.retention is None or self.retention.policy == "lru":
            return next(iter(self._entries))
        return next(iter(self._by_owner[self.retention.victim(self._by_owner)]))

    def _evict(self, key: int) -> None:
        owner = self._owner[key]
        spill = self.spill is not None and not (owner is not None and owner.finished())
        snap = self._whole(key) if spill else None
        if self.retention is not None:
            self.retention.evicted(self.tier, owner)
        head = self._drop(key)
        if head is not None:
            self._let_go(head)
        if spill:
            assert self.spill is not None
            self.spill(snap, owner)

    def newest_key(self) -> int:
        """The key the last ``put`` gave its entry."""
        return next(reversed(self._entries))

    def drop(self, key: int) -> None:
        """Remove an entry (not an eviction: the caller gave up on it)."""
        self._release(key)

    def owner_of(self, key: int) -> KvOwner | None:
        return self._owner[key]

    def drop_owned(self, owners: set[Any]) -> int:
        """Drop every entry of these owners (their sessions were released); how many."""
        keys = [k for o in owners for k in self._by_owner.get(o, ())]
        for key in keys:
            self._release(key)
        return len(keys)

    def _prefixes_of(self, tokens: list[int], salt: str | None, lora: LoraSet) -> list[int]:
        """The entries of ``salt`` and ``lora`` whose tokens are a prefix of ``tokens`` (or equal them).

        In token order, everything between a prefix p of ``tokens`` and ``tokens`` starts
        with p. So the greatest entry not above ``tokens[:hi]`` is either a prefix (found),
        or shares ``n`` tokens with it, and any prefix before it is at most ``n`` long: each
        step finds one or shortens the search."""
        found: list[int] = []
        hi = len(tokens)
        run = (salt or "", lora)
        i = bisect_right(self._sorted, (*run, tokens), key=self._order_of)
        while hi and i:
            i -= 1
            key = self._sorted[i]
            entry = self._entries[key]
            if (entry.salt or "", entry.lora) != run:
                break  # below this run: only other salts' (or sets') entries further down
            held = entry.tokens
            n = common_prefix_len(held, tokens[:hi])
            if n == len(held):
                found.append(key)
                hi = n
                continue
            if n < hi:
                hi = n
                i = bisect_right(self._sorted, (*run, tokens[:hi]), key=self._order_of, hi=i + 1)
        return found

    def best(self, prompt: Sequence[int], salt: str | None = None, lora: LoraSet = ()) -> CacheHit | None:
        """The entry of ``salt`` and ``lora`` sharing the longest prefix with ``prompt`` (None
        when none shares any): one of the two entries around the prompt's place in their run."""
        prompt = list(prompt)
        run = (salt or "", lora)
        i = bisect_left(self._sorted, (*run, prompt), key=self._order_of)
        best: CacheHit | None = None
        for key in self._sorted[max(0, i - 1) : i + 1]:
            entry = self._entries[key]
            if (entry.salt or "", entry.lora) != run:
                continue  # another salt's (or set's) run begins or ends here
            n = common_prefix_len(entry.tokens, prompt)
            if n and (best is None or n > best.n_common):
                checkpoint = getattr(entry, "checkpoint", None)
                best = CacheHit(key, n, len(entry.tokens), checkpoint.n_tokens if checkpoint is not None else None)
        return best

    def take(self, key: int) -> Snapshot:
        """Remove an entry to restore it (the slot holds it from then on)."""
        snap = self._whole(key)
        self._release(key)
        self.restored += 1
        self.restored_tokens += len(snap.tokens)
        return snap

    def lend(self, key: int) -> Snapshot:
        """A copy of an entry to restore, the entry kept: for a request that continues less of
        it than a block short of the whole (it would copy the rest back at once)."""
        snap = self._whole(key)
        if snap is self._entries[key]:  # held whole: a restore rewrites its buffer in place
            snap = replace(snap, buf=bytearray(snap.buf))
        self.restored += 1
        self.restored_tokens += len(snap.tokens)
        return snap

    def clear(self) -> None:
        """Drop everything (the context or the model changed: the states no longer fit)."""
        self._entries.clear()
        self._sorted.clear()
        self._owner.clear()
        self._by_owner.clear()
        self._head.clear()
        self.nbytes = 0
        if self.watcher is not None:
            self.watcher.cleared()

    def _release(self, key: int) -> None:
        """Take ``key`` out, and its head when no other entry uses it."""
        self._unlink(key)
        head = self._head.pop(key, None)
        if head is not None:
            self._let_go(head)

    def _unlink(self, key: int) -> None:
        """Take ``key`` out of both orders ((salt, lora, tokens) are unique: put drops an equal
        entry); its head (``_head``) stays the caller's to let go."""
        i = bisect_left(self._sorted, self._entries[key].order, key=self._order_of)
        assert self._sorted[i] == key
        del self._sorted[i]
        self.nbytes -= self._entries.pop(key).nbytes
        owner = self._owner.pop(key)
        bucket = self._by_owner[owner]
        del bucket[key]
        if not bucket:
            del self._by_owner[owner]
        if self.watcher is not None:  # taken back into a slot or evicted: no longer in RAM
            self.watcher.entry_removed(key)

    def _drop(self, key: int) -> _Head | None:
        """Drop an entry for room or for one that extends it; returns its head, still held
        (the caller lets it go: ``_let_go``)."""
        self._unlink(key)
        self.evicted += 1
        return self._head.pop(key, None)
