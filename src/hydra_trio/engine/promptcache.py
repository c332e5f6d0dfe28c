"""The host-memory prompt cache: slots' KV kept past the slots (llama-server's --cache-ram).

When a slot is about to drop a history it holds (a new prompt shares little with it), the
engine copies the slot's state here first; when a prompt arrives whose prefix a cached
entry holds better than any slot, the entry goes back into the slot it gets. Entries are
snapshots as the backend reads them (``LlamaBackend.snapshot``: the state in this context's
own form with room before it, and the tail logits when the slot had them), so a swap back
is one restore and no copy. Bounded by bytes, least recently used out first.

Pure: no llama_cpp import; the engine does the GPU-worker calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count

from .text import common_prefix_len


@dataclass(slots=True)
class Snapshot:
    """A slot's KV copied out: ``buf[offset:]`` is the state (then the tail logits, when
    ``has_logits``); the ``offset`` bytes before it give a restore room to rewrite it."""

    tokens: list[int]
    buf: bytearray
    offset: int
    has_logits: bool

    @property
    def nbytes(self) -> int:
        return len(self.buf)


@dataclass(frozen=True, slots=True)
class CacheHit:
    key: int
    n_common: int  # prompt tokens the entry holds


@dataclass(slots=True)
class PromptCache:
    max_bytes: int
    _entries: OrderedDict[int, Snapshot] = field(default_factory=OrderedDict)
    _keys: count[int] = field(default_factory=count)
    nbytes: int = 0
    saved: int = 0  # entries put here
    restored: int = 0  # entries taken back into a slot
    restored_tokens: int = 0  # their positions: prompt tokens not recomputed
    evicted: int = 0  # entries dropped for room (or replaced by a longer one)

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, snap: Snapshot) -> bool:
        """Keep a snapshot, evicting the least recently used for room; False when it alone
        is larger than the cache. An entry it extends (a prefix of its tokens) is dropped:
        the new one serves every prompt the old one did."""
        if snap.nbytes > self.max_bytes or not snap.tokens:
            return False
        for key, old in list(self._entries.items()):
            if len(old.tokens) <= len(snap.tokens) and snap.tokens[: len(old.tokens)] == old.tokens:
                self._drop(key)
        while self._entries and self.nbytes + snap.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[next(self._keys)] = snap
        self.nbytes += snap.nbytes
        self.saved += 1
        return True

    def best(self, prompt: Sequence[int]) -> CacheHit | None:
        """The entry sharing the longest prefix with ``prompt`` (None when none shares any)."""
        best: CacheHit | None = None
        for key, snap in self._entries.items():
            n = common_prefix_len(snap.tokens, prompt)
            if n and (best is None or n > best.n_common):
                best = CacheHit(key, n)
        return best

    def take(self, key: int) -> Snapshot:
        """Remove an entry to restore it (the slot holds it from then on)."""
        snap = self._entries.pop(key)
        self.nbytes -= snap.nbytes
        self.restored += 1
        self.restored_tokens += len(snap.tokens)
        return snap

    def clear(self) -> None:
        """Drop everything (the context or the model changed: the states no longer fit)."""
        self._entries.clear()
        self.nbytes = 0

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
        self.evicted += 1
