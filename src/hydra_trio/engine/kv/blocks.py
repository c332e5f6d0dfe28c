"""Which full KV blocks the slots hold, as chained block hashes, and the KV events
(wire/kvevents.py) that tell a router each change.

A slot holding N positions holds its first ``N // block_size`` blocks (medium "GPU"); a host
prompt-cache entry (promptcache.py) holding N positions holds as many on medium "CPU"
(``HostBlocks``), so that a router can tell which engine keeps a session's history in RAM. A block's hash names
its tokens and, through its parent's hash, every token before it, so several slots holding
the same prefix hold the same blocks: a block is stored when the first slot gets it and
removed when the last one drops it. The router matches requests on its own hashes of the
tokens; these only chain the blocks and name them for removal.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import xxhash

from ...wire.kvevents import MEDIUM_HOST, Event, all_blocks_cleared, block_removed, block_stored
from ..llama import LoraSet


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """64-bit hash of one block's tokens, seeded with its parent's (a chain's first: 0)."""
    return xxhash.xxh3_64_intdigest(array("i", tokens).tobytes(), seed=parent or 0)


def chain_root(salt: str | None, lora_name: str | None = None) -> int | None:
    """What a chain's first block is seeded with: nothing (0) unsalted on the base model, else
    the hash of the cache_salt and the LoRA adapter set's name (engine/adapters.py ``label``),
    as vLLM mixes the salt and the adapter's name into a block's hash (its extra keys): the
    same tokens under two salts or sets are two chains from the first block on, told apart
    by every later block too."""
    if salt is None and lora_name is None:
        return None
    key = b"" if salt is None else b"cache_salt\0" + salt.encode("utf-8", "surrogatepass")
    if lora_name is not None:
        key += b"\0lora_name\0" + lora_name.encode("utf-8", "surrogatepass")
    return xxhash.xxh3_64_intdigest(key) or 1


# A LoRA adapter set's (lora_id, lora_name) in a BlockStored (engine/adapters.py ``event_fields``).
LoraFields = Callable[[LoraSet], tuple[int | None, str | None]]


def _no_adapters(_lora: LoraSet) -> tuple[int | None, str | None]:
    return None, None


class Watched(Protocol):
    """A backend whose slot changes are told to its ``watcher`` (engine/llama/context.py)."""

    watcher: SlotBlocks | None


class SlotBlocks:
    """The slots' block chains and reference counts. ``slot_changed`` runs on the GPU worker
    after every change of a slot's KV; the events it makes wait in ``pending`` (a deque:
    appended by the worker, taken by the trio thread after each worker call, so it holds at
    most one call's events)."""

    def __init__(self, n_slots: int, block_size: int, lora_fields: LoraFields = _no_adapters) -> None:
        self.block_size = block_size
        self._lora_fields = lora_fields
        self._chains: list[list[int]] = [[] for _ in range(n_slots)]
        self._lora: list[LoraSet] = [() for _ in range(n_slots)]  # each chain's adapter set
        self._refs: dict[int, int] = {}  # block hash -> slots holding it
        self._tokens: dict[int, tuple[int, ...]] = {}  # block hash -> its tokens (for resync)
        self.pending: deque[Event] = deque()
        # The agent session of the request holding each slot (set at its claim): its stores
        # name it (``session_id``, map encoding).
        self.sessions: list[str | None] = [None] * n_slots

    def slot_changed(
        self, slot: int, tokens: Sequence[int], kept: int, salt: str | None = None, lora: LoraSet = ()
    ) -> None:
        """The slot now holds ``tokens``, computed under ``salt`` and the adapter set ``lora``;
        its first ``kept`` positions are unchanged since the last call (so a generation step
        costs nothing until a block fills). A slot's salt and set change only with its
        history emptied first."""
        bs = self.block_size
        chain = self._chains[slot]
        n_full = len(tokens) // bs
        keep = min(len(chain), kept // bs, n_full)
        self._lora[slot] = lora
        lora_id, lora_name = self._lora_fields(lora)
        parent = chain[keep - 1] if keep else chain_root(salt, lora_name)
        fresh: list[int] = []
        for i in range(keep, n_full):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs])
            fresh.append(parent)
        # A restore or a cut may leave blocks past ``keep`` as they were: those stay.
        old = chain[keep:]
        same = 0
        while same < min(len(old), len(fresh)) and old[same] == fresh[same]:
            same += 1
        gone = [h for h in reversed(old[same:]) if self._unref(h)]
        if gone:
            self.pending.append(block_removed(gone))
        start = keep + same
        added = fresh[same:]
        del chain[start:]
        chain.extend(added)
        # Blocks another slot holds too are already stored; they can only lead the new run
        # (a block's hash covers its whole prefix, which that slot then holds as well).
        new_from = 0
        for i, h in enumerate(added, start):
            seen = self._refs.get(h, 0)
            self._refs[h] = seen + 1
            if seen:
                new_from += 1
            else:
                self._tokens[h] = tuple(tokens[i * bs : (i + 1) * bs])
        if new_from < len(added):
            first = start + new_from
            self.pending.append(
                block_stored(
                    added[new_from:],
                    chain[first - 1] if first else None,  # a chain's first block: no parent, salted or not
                    tokens[first * bs : n_full * bs],
                    bs,
                    lora_id=lora_id,
                    lora_name=lora_name,
                    session_id=self.sessions[slot],
                )
            )

    def watch(self, backend: Watched, publish: Callable[[list[Event]], None]) -> Callable[[], None]:
        """Be told of every change of ``backend``'s slots; returns what the GPU worker calls
        after each call (``GpuWorker.after_call``): the pending events go to ``publish``."""
        backend.watcher = self
        return lambda: publish(self.take()) if self.pending else None

    def rewatch(self, backend: Watched) -> None:
        """``backend`` serves now (a T2/T3 change emptied every slot): watch it, and say so."""
        backend.watcher = self
        self.all_cleared()

    def all_cleared(self) -> None:
        """Every slot was emptied at once (a context rebuilt or a model reloaded)."""
        for chain in self._chains:
            chain.clear()
        self._refs.clear()
        self._tokens.clear()
        self.pending.append(all_blocks_cleared())

    def resync(self) -> None:
        """Tell everything held, from scratch: AllBlocksCleared, then each chain once. A
        subscriber that joined late, lost batches or saw this engine restart then holds
        exactly the slots' blocks, whatever it held before. Runs on the GPU worker, so that
        no slot change comes between."""
        self.pending.append(all_blocks_cleared())
        told: set[int] = set()
        for chain, lora in zip(self._chains, self._lora, strict=True):
            first = next((i for i, h in enumerate(chain) if h not in told), len(chain))
            if first == len(chain):
                continue
            run = chain[first:]
            told.update(run)
            tokens = [t for h in run for t in self._tokens[h]]
            lora_id, lora_name = self._lora_fields(lora)
            self.pending.append(
                block_stored(
                    run,
                    chain[first - 1] if first else None,
                    tokens,
                    self.block_size,
                    lora_id=lora_id,
                    lora_name=lora_name,
                )
            )

    def _unref(self, h: int) -> bool:
        """Drop one slot's hold on ``h``; True when no slot holds it any more."""
        left = self._refs[h] - 1
        if left:
            self._refs[h] = left
            return False
        del self._refs[h]
        del self._tokens[h]
        return True

    @property
    def n_held(self) -> int:
        return len(self._refs)

    def held(self) -> dict[int, int]:
        """Block hash -> slots holding it (for /slots and tests)."""
        return dict(self._refs)

    def take(self) -> list[Event]:
        """The events made since the last call, in order (safe while the worker appends)."""
        out = []
        while self.pending:
            out.append(self.pending.popleft())
        return out


class HostBlocks:
    """The host prompt cache's blocks (medium "CPU"; the disk tier's: "DISK"), told as each
    entry comes and goes.
    Used on the trio thread only (the prompt cache lives there): its events go to
    ``publish`` at once. A block several entries share (one system prompt, many sessions)
    is stored with the first and removed with the last, as for slots. The same tokens in a
    slot and in RAM are the same hashes on two media: a router holds one entry per medium."""

    def __init__(
        self,
        block_size: int,
        publish: Callable[[list[Event]], None],
        lora_fields: LoraFields = _no_adapters,
        medium: str = MEDIUM_HOST,
    ) -> None:
        self.block_size = block_size
        self._publish = publish
        self._lora_fields = lora_fields
        self.medium = medium
        self._chains: dict[int, list[int]] = {}  # entry key -> its block hashes
        self._lora: dict[int, LoraSet] = {}  # entry key -> its adapter set (the base model's: absent)
        self._refs: dict[int, int] = {}  # block hash -> entries holding it
        self._tokens: dict[int, tuple[int, ...]] = {}  # block hash -> its tokens (for resync)
        self._parents: dict[int, int | None] = {}  # block hash -> its parent's (None: a chain's first)

    def entry_stored(
        self, key: int, tokens: Sequence[int], salt: str | None, lora: LoraSet = (), session_id: str | None = None
    ) -> None:
        bs = self.block_size
        chain: list[int] = []
        lora_id, lora_name = self._lora_fields(lora)
        parent = chain_root(salt, lora_name)
        for i in range(len(tokens) // bs):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs])
            chain.append(parent)
        self._chains[key] = chain
        if lora:
            self._lora[key] = lora
        # Held blocks lead the chain (a block's hash covers its prefix, held with it).
        new_from = 0
        for i, h in enumerate(chain):
            seen = self._refs.get(h, 0)
            self._refs[h] = seen + 1
            if seen:
                new_from = i + 1
            else:
                self._tokens[h] = tuple(tokens[i * bs : (i + 1) * bs])
                self._parents[h] = chain[i - 1] if i else None
        if new_from < len(chain):
            parent_hash = chain[new_from - 1] if new_from else None
            self._publish([
                block_stored(
                    chain[new_from:], parent_hash, tokens[new_from * bs : len(chain) * bs], bs, self.medium,
                    lora_id=lora_id, lora_name=lora_name, session_id=session_id,
                )
            ])

    def entry_removed(self, key: int) -> None:
        self._lora.pop(key, None)
        gone = []
        for h in reversed(self._chains.pop(key, [])):
            left = self._refs[h] - 1
            if left:
                self._refs[h] = left
                continue
            del self._refs[h], self._tokens[h], self._parents[h]
            gone.append(h)
        if gone:
            self._publish([block_removed(gone, self.medium)])

    def cleared(self) -> None:
        """The cache was emptied (a context rebuilt or a model reloaded): told as removals,
        which hold even when the change then fails and no AllBlocksCleared follows."""
        if self._refs:
            self._publish([block_removed(list(self._refs), self.medium)])
        self._chains.clear()
        self._lora.clear()
        self._refs.clear()
        self._tokens.clear()
        self._parents.clear()

    def publish_resync(self) -> None:
        if self._chains:
            self._publish(self.resync_events())

    def resync_events(self) -> list[Event]:
        """Every block held, each chain once (after the slots' AllBlocksCleared)."""
        told: set[int] = set()
        out: list[Event] = []
        for key, chain in self._chains.items():
            run = [h for h in chain if h not in told]
            if not run:
                continue
            told.update(run)
            tokens = [t for h in run for t in self._tokens[h]]
            lora_id, lora_name = self._lora_fields(self._lora.get(key, ()))
            out.append(
                block_stored(
                    run,
                    self._parents[run[0]],
                    tokens,
                    self.block_size,
                    self.medium,
                    lora_id=lora_id,
                    lora_name=lora_name,
                )
            )
        return out

    @property
    def n_held(self) -> int:
        return len(self._refs)

    def held(self) -> dict[int, int]:
        """Block hash -> entries holding it (for tests)."""
        return dict(self._refs)
