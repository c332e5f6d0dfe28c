"""KV exports under a lease: a prefill engine's copies of prompt KV, waiting to be pulled.

An export is a v2 blob (head, llama state, logits) copied out of a slot into host memory,
so the slot is free again as soon as the copy is made: an export never holds a slot. It
lives until one of: a decode engine pulls it (KV_PULL takes it out: released once pulled),
its lease ends (``ttl_s`` after it was made), or room is needed for a newer one (the
store is bounded by ``max_bytes``; the oldest exports are evicted first). Each way out is
counted in ``hydra_kv_exports_total{outcome}``.

With a shared-memory area (decode/shm.py, ``--kv-shm-dir``), an export's bytes live in a
file there, so that a decode engine on the same host can map them instead of receiving
them: a pull of that form hands the file over (the decode engine unlinks it once mapped;
if it never does, the name is removed when the lease would have ended).
"""

from __future__ import annotations

import logging
import math
import secrets
from collections import OrderedDict
from dataclasses import dataclass
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


class ExportStore:
    def __init__(
        self, *, max_bytes: int, ttl_s: float, registry: CollectorRegistry, shm: ShmArea | None = None
    ) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.shm = shm
        self.bytes_held = 0
        self._exports: OrderedDict[str, Export] = OrderedDict()  # oldest first
        # Files handed to a decode engine (which unlinks them once mapped), with when to
        # remove them if it never did (it failed between the reply and the mapping).
        self._handed: list[tuple[float, ShmFile]] = []
        self._changed = trio.Event()
        self.metrics = KvTransferMetrics(registry, self)

    def __len__(self) -> int:
        return len(self._exports)

    def put(self, parts: list[Part], n_past: int, kv_hash: str, identity: dict[str, Any]) -> Export | None:
        """Keep a blob under a new lease; None when it alone is larger than the store."""
        nbytes = sum(len(p) for p in parts)
        if nbytes > self.max_bytes:
            self.metrics.exports.labels("refused").inc()
            log.warning("KV export of %d bytes refused: --kv-export-max-bytes is %d", nbytes, self.max_bytes)
            return None
        while self.bytes_held + nbytes > self.max_bytes:
            _, oldest = self._exports.popitem(last=False)
            self._drop(oldest, "evicted")
            log.info("KV export %s evicted (%d bytes) to make room", oldest.id, oldest.nbytes)
        shared = self.shm.create(parts) if self.shm is not None else None
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

    def take(self, export_id: str, *, hand_over: bool = False) -> Export | None:
        """Remove and return a live export (a pull); None if unknown, expired or taken.
        ``hand_over``: the puller maps its shared file (and unlinks it)."""
        self.sweep()
        export = self._exports.pop(export_id, None)
        if export is not None:
            if hand_over and export.shm is not None:  # the file is the puller's to unlink now
                self._handed.append((trio.current_time() + self.ttl_s, export.shm))
                self._drop(export, "pulled", unlink=False)
            else:
                self._drop(export, "pulled")
        return export

    def sweep(self) -> None:
        now = trio.current_time()
        while self._handed and self._handed[0][0] <= now:
            self._handed.pop(0)[1].unlink()  # a puller that never mapped it
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
        for _, shared in self._handed:
            shared.unlink()
        self._handed.clear()
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
        """Return at the next put, take, expiry or eviction."""
        await self._changed.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Expire leases on time (not only at the next access), so an unpulled export's
        memory is returned when its lease ends. Runs until cancelled; drops all exports then."""
        task_status.started()
        try:
            while True:
                self.sweep()
                deadline = next(iter(self._exports.values())).expires_at if self._exports else math.inf
                with trio.move_on_at(deadline):
                    await self._changed.wait()
        finally:
            self.clear()
