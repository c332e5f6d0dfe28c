"""KV exports under a lease: a prefill engine's copies of prompt KV, waiting to be pulled.

An export is a v2 blob (head, llama state, logits) copied out of a slot into host memory,
so the slot is free again as soon as the copy is made: an export never holds a slot. It
lives until one of: a decode engine pulls it (KV_PULL takes it out: released once pulled),
its lease ends (``ttl_s`` after it was made), or room is needed for a newer one (the
store is bounded by ``max_bytes``; the oldest exports are evicted first). Each way out is
counted in ``hydra_kv_exports_total{outcome}``.

With a shared-memory area (handoff/shm.py, ``--kv-shm-dir``), an export's bytes live in a
file there, so that a decode engine on the same host can map them instead of receiving
them: a pull of that form hands the file over (the decode engine unlinks it once mapped,
or once its pull failed). A handed-over file still counts against ``max_bytes`` until it
is seen unlinked: a puller that never unlinks (a failure between the reply and the
mapping, a hostile client) cannot make the folder hold more than the bound. Such a file is
removed when the lease would have ended (the run loop wakes for it), or sooner when room
is needed (before any export waiting to be pulled is evicted).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge

from .shm import ShmArea, ShmFile

log = logging.getLogger(__name__)

Part = bytes | bytearray | memoryview


@dataclass(slots=True)
class Export:
    id: str
    parts: list[Part]  # the v2 blob: head, llama state, logits
    n_past: int
    kv_hash: str
    # The identity of the model that made the KV, fixed when the export is made: a staged
    # model reload (CONFIGURE T3) must not relabel KV of the previous model.
    identity: dict[str, Any]
    expires_at: float  # trio.current_time()
    shm: ShmFile | None = None  # the shared file ``parts`` view, when there is one

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.parts)


@dataclass(frozen=True, slots=True)
class Handed:
    """A shared file handed to a puller, which should have unlinked it by ``deadline``."""

    deadline: float  # trio.current_time()
    path: Path
    nbytes: int

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def gone(self) -> bool:
        """Whether the puller unlinked it (the names hold 128 random bits: never reused)."""
        try:
            os.lstat(self.path)
        except FileNotFoundError:
            return True
        return False


class KvTransferMetrics:
    """Counters of both sides of a hand-off (one set per engine registry)."""

    def __init__(self, registry: CollectorRegistry, store: ExportStore) -> None:
        self.exports = Counter(
            "hydra_kv_exports",
            "KV exports by outcome: created, pulled, expired, evicted (room for a newer one), "
            "refused (larger than --kv-export-max-bytes alone)",
            ["outcome"],
            registry=registry,
        )
        self.pulls = Counter(
            "hydra_kv_pulls",
            "decode-side hand-offs: restored, or fallback (prefilled locally) with the reason",
            ["outcome", "reason"],
            registry=registry,
        )
        self.pull_bytes = Counter("hydra_kv_pull_bytes", "KV bytes pulled from prefill engines", registry=registry)
        Gauge("hydra_kv_exports_held", "KV exports waiting to be pulled", registry=registry).set_function(
            lambda: len(store)
        )
        Gauge("hydra_kv_export_bytes", "bytes held by KV exports", registry=registry).set_function(
            lambda: store.bytes_held
        )
        Gauge(
            "hydra_kv_export_handed_bytes",
            "bytes of shared-memory files handed to a puller and not yet seen unlinked",
            registry=registry,
        ).set_function(lambda: store.handed_bytes)


class ExportStore:
    def __init__(
        self, *, max_bytes: int, ttl_s: float, registry: CollectorRegistry, shm: ShmArea | None = None
    ) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.shm = shm
        self.bytes_held = 0  # exports waiting to be pulled
        self.handed_bytes = 0  # handed-over files not yet seen unlinked
        self._reserved = 0  # puts copying into a new shared file right now
        self._exports: OrderedDict[str, Export] = OrderedDict()  # oldest first
        # Files handed to a decode engine (which unlinks them once mapped), oldest first, with
        # when to remove them if it never did (it failed between the reply and the mapping).
        # Only the name is kept: this process's mapping goes with the export and its reply.
        self._handed: deque[Handed] = deque()
        self._changed = trio.Event()
        self.metrics = KvTransferMetrics(registry, self)

    def __len__(self) -> int:
        return len(self._exports)

    async def put(
        self, parts: list[Part], n_past: int, kv_hash: str, identity: dict[str, Any]
    ) -> Export | None:
        """Keep a blob under a new lease; None when it alone is larger than the store (or
        when puts in progress hold the rest of it)."""
        nbytes = sum(len(p) for p in parts)
        if nbytes > self.max_bytes:
            self.metrics.exports.labels("refused").inc()
            log.warning("KV export of %d bytes refused: --kv-export-max-bytes is %d", nbytes, self.max_bytes)
            return None
        if not self._make_room(nbytes):
            self.metrics.exports.labels("refused").inc()
            log.warning("KV export of %d bytes refused: exports being copied hold the rest of "
                        "--kv-export-max-bytes", nbytes)
            return None
        # The room is taken before the copy (off this thread) starts: concurrent puts
        # cannot together pass the bound.
        self._reserved += nbytes
        try:
            shared = await self.shm.create(parts) if self.shm is not None else None
        finally:
            self._reserved -= nbytes
        if shared is not None:  # the bytes now live in the shared file; the copies go
            parts = list(shared.views([len(p) for p in parts]))
        export = Export(
            secrets.token_urlsafe(16), parts, n_past, kv_hash, identity, trio.current_time() + self.ttl_s, shared
        )
        self._exports[export.id] = export
        self.bytes_held += nbytes
        self.metrics.exports.labels("created").inc()
        self._wake()
        return export

    def occupied(self) -> int:
        """What counts against ``max_bytes``: exports, handed-over files, puts in progress."""
        return self.bytes_held + self.handed_bytes + self._reserved

    def _make_room(self, nbytes: int) -> bool:
        """Free room for ``nbytes`` (at most ``max_bytes``): handed-over files the puller
        never unlinked go first (served already: a pull that worked unlinks at once), then
        the oldest exports. False when puts in progress hold the rest."""
        if self.occupied() + nbytes <= self.max_bytes:
            return True
        self._forget_unlinked()
        while self.occupied() + nbytes > self.max_bytes:
            if self._handed:
                handed = self._handed.popleft()
                self._unlink_handed(handed)
                log.info("KV export file %s, handed over and never unlinked, removed to make room", handed.path.name)
            elif self._exports:
                _, oldest = self._exports.popitem(last=False)
                self._drop(oldest, "evicted")
                log.info("KV export %s evicted (%d bytes) to make room", oldest.id, oldest.nbytes)
            else:
                return False
        return True

    def _forget_unlinked(self) -> None:
        kept: deque[Handed] = deque()
        for handed in self._handed:
            if handed.gone():
                self.handed_bytes -= handed.nbytes
            else:
                kept.append(handed)
        self._handed = kept

    def _unlink_handed(self, handed: Handed) -> None:
        handed.unlink()
        self.handed_bytes -= handed.nbytes
        self._wake()

    def take(self, export_id: str, *, hand_over: bool = False) -> Export | None:
        """Remove and return a live export (a pull); None if unknown, expired or taken.
        ``hand_over``: the puller maps its shared file (and unlinks it)."""
        self.sweep()
        export = self._exports.pop(export_id, None)
        if export is not None:
            if hand_over and export.shm is not None:  # the file is the puller's to unlink now
                self._handed.append(Handed(trio.current_time() + self.ttl_s, export.shm.path, export.nbytes))
                self.handed_bytes += export.nbytes
                self._drop(export, "pulled", unlink=False)
            else:
                self._drop(export, "pulled")
        return export

    def sweep(self) -> None:
        now = trio.current_time()
        while self._handed and self._handed[0].deadline <= now:  # a puller that never unlinked it
            self._unlink_handed(self._handed.popleft())
        while self._exports:
            oldest = next(iter(self._exports.values()))  # leases are equal: oldest ends first
            if oldest.expires_at > now:
                break
            del self._exports[oldest.id]
            self._drop(oldest, "expired")
            log.info("KV export %s expired unpulled (%d bytes)", oldest.id, oldest.nbytes)

    def clear(self) -> None:
        for export in list(self._exports.values()):
            self._drop(export, "expired")
        self._exports.clear()
        while self._handed:
            self._unlink_handed(self._handed.popleft())
        if self.shm is not None:
            self.shm.close()

    def _drop(self, export: Export, outcome: str, *, unlink: bool = True) -> None:
        if unlink and export.shm is not None:
            export.shm.unlink()  # the pages go with the last mapping (a reply being sent)
        self.bytes_held -= export.nbytes
        self.metrics.exports.labels(outcome).inc()
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        """Return at the next put, take, expiry, eviction or removal of a handed-over file."""
        await self._changed.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Expire leases on time (not only at the next access), so an unpulled export's
        memory is returned when its lease ends. Runs until cancelled; drops all exports then."""
        task_status.started()
        try:
            while True:
                self.sweep()
                deadline = min(
                    next(iter(self._exports.values())).expires_at if self._exports else math.inf,
                    self._handed[0].deadline if self._handed else math.inf,  # wake for those too
                )
                with trio.move_on_at(deadline):
                    await self._changed.wait()
        finally:
            self.clear()
