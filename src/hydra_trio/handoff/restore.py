"""The decode side of a P/D hand-off through a router's ``kv_transfer_params``.

``Handoff``: check the identity the export claims, then, before the request claims a
slot, pull it over the binary RPC (``pull.py``) and check it (caps, hash, identity of
the serving engine, the prompt it holds); in the slot, restore it and let the normal
generation continue from it. Any failure falls back to prefilling locally and says why (``report()``,
``hydra_kv_pulls_total{outcome="fallback",reason}``): the text is the same either way,
only the prompt work differs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from ..concurrency import ByteBudget
from ..config import Settings
from ..engine import Engine, LoraSet, SlotLease
from ..wire.errors import ProtocolError
from ..wire.kvblob import KvBlob
from ..wire.kvpull import HandoffParams, parse_handoff_params
from .exports import ExportStore
from .pull import PULL_FAILED, PullFailed, network_failure, pull_export

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Handoff:
    """One request's attempt to continue from a prefill engine's export."""

    params: HandoffParams | None
    exports: ExportStore  # for the metrics
    trace: str = ""  # the router's X-Request-Id: on the KV_PULL, for the prefill engine's logs
    status: str = "pending"  # restored | fallback (pending: the request ended before its slot)
    reason: str = ""
    detail: str = ""
    kv_bytes: int = 0
    pull_ms: float = 0.0
    restore_ms: float = 0.0
    n_restored: int = 0
    transport: str = ""  # how the bytes came: "shm" (mapped on this host) or "tcp"
    engine: Engine | None = None  # the engine whose slot it restores into (None: it names no export)
    lora: LoraSet = ()  # the LoRA adapter set of the request: the export's must be the same
    # The fetched blob until the restore, and the payload-budget bytes it holds.
    _blob: KvBlob | None = field(default=None, repr=False)
    _budget: ByteBudget | None = field(default=None, repr=False)
    _held: int = 0
    _released: trio.Event = field(default_factory=trio.Event, repr=False)

    @classmethod
    async def begin(
        cls, engine: Engine, exports: ExportStore, raw: object, *, trace: str = "", lora: LoraSet = ()
    ) -> Handoff | None:
        """The hand-off a request's ``kv_transfer_params`` (``raw``) asks for: None when it
        names no hydra export; already a fallback when it is malformed or names KV of
        another model, or made under another LoRA adapter set than the request's ``lora``
        (the identity gate, before any byte moves)."""
        try:
            params = parse_handoff_params(raw)
        except ProtocolError as err:
            h = cls(None, exports, trace, engine=engine, lora=lora)
            h._fail("bad_params", err.message)
            return h
        if params is None:
            return None
        h = cls(params, exports, trace, engine=engine, lora=lora)
        admitted = await engine.admit(None, {**params.identity, "kv_cache": params.kv_cache}, lora=lora)
        assert admitted.match is not None, "claims were given"
        if admitted.match.lora_match is False:
            h._fail("lora_mismatch", f"export was made under another LoRA adapter set: {admitted.match.reason}")
        elif not admitted.match.accepted:
            h._fail("identity_mismatch", f"export was made by another model: {admitted.match.reason}")
        elif admitted.layout_problem is not None:
            h._fail("layout_mismatch", f"export's KV cache layout differs: {admitted.layout_problem}")
        return h

    async def fetch(self, settings: Settings, budget: ByteBudget, prompt_tokens: list[int]) -> None:
        """Pull the export and check it (caps, hash, the serving engine's identity, the prompt
        it holds), BEFORE the request claims a slot: a peer that is gone, refuses, resets or
        stays silent holds no slot. On any failure the request prefills locally.

        The pulled bytes come from the payload budget (``--max-inflight-bytes``, shared with
        RPC payloads and uploads), taken once the peer's reply announces them, and are held
        until ``restore`` (or ``release``: the request ended first). ``--kv-pull-timeout-s``
        bounds the pull and the wait for budget room together; a client that leaves cancels it.

        The claim (``kv_bytes``, the client's number) is checked against --max-kv-bytes
        before anything moves: the budget's queue is first come, first served, and a claim
        it could never grant would hold everyone behind it until its deadline.

        A network failure (``pull_failed``, the one reason for a closed, a silent and a
        talking port) falls back at once: --kv-pull-allow decides which hosts may be pulled
        from, so the timing says nothing of hosts the client could not already name. With
        --kv-pull-uniform-timing it answers at the deadline instead, as a silent peer does;
        that wait holds no slot and no budget (docs/reliability.md)."""
        if self.status != "pending" or self.params is None:
            return
        n = self.params.kv_bytes
        if n > settings.max_kv_bytes:
            self._fail("too_large", f"export of {n} bytes exceeds --max-kv-bytes {settings.max_kv_bytes}")
            return
        deadline = trio.current_time() + settings.kv_pull_timeout_s
        try:
            blob = await self._pull(settings, budget, deadline)
            if blob is not None and (
                len(blob.tokens) > len(prompt_tokens) or blob.tokens != prompt_tokens[: len(blob.tokens)]
            ):
                self._fail("prompt_mismatch", "the export holds another prompt than this request's")
                blob = None
        except BaseException:
            self.release()
            raise
        if blob is None:
            self.release()  # budget back before any uniform wait
            if self.reason == PULL_FAILED and settings.kv_pull_uniform_timing:
                await trio.sleep_until(deadline)
            return
        self._blob = blob

    def release(self) -> None:
        """Give back what the pulled bytes hold (idempotent): after the restore, or when the
        request ends without one."""
        self._blob = None
        if self._held and self._budget is not None:
            self._budget.release(self._held)
        self._held = 0
        self._released.set()

    @property
    def holds_budget(self) -> bool:
        return self._held > 0

    async def hold_until_released(self) -> None:
        """Run in the request's own nursery: whatever ends the request (a refused claim, the
        client leaving, the response sent), the pulled bytes' budget goes back with it."""
        try:
            await self._released.wait()
        finally:
            self.release()

    async def restore(
        self, lease: SlotLease, salt: str | None = None, *, let_go: Callable[[list[KvBlob]], None] | None = None
    ) -> None:
        """Restore the fetched blob into the caller's (claimed) slot, with the logits that
        came with it, as the history of the request's cache ``salt`` and LoRA adapter set. On failure the slot
        is as it was and the request prefills locally. The budget goes back either way.

        ``let_go(holder)``: drops the blob's last reference (``holder.clear()``) elsewhere
        than here, before the first token: letting a shared-memory export's mapping go
        unmaps it and frees the file's pages, 100-170 ms for 148.5 MB on a loaded 2-core VM
        (measured between the restore's return and the first token)."""
        blob = self._blob
        try:
            if blob is None:
                return
            t0 = time.perf_counter()
            try:
                await lease.restore(blob, salt=salt, lora=self.lora)
            except ProtocolError as err:
                self._fail("restore_failed", err.message)
                return
            self.restore_ms = (time.perf_counter() - t0) * 1000.0
            self.n_restored = blob.n_past
            self.status = "restored"
            self.exports.metrics.pulls.labels("restored", "").inc()
        finally:
            holder = [] if blob is None else [blob]
            del blob
            self.release()
            if let_go is not None and holder:
                let_go(holder)

    async def _pull(self, settings: Settings, budget: ByteBudget, deadline: float) -> KvBlob | None:
        params, engine = self.params, self.engine
        assert params is not None and engine is not None

        async def reserve(n: int) -> None:
            try:
                await budget.take(n, within_s=max(0.0, deadline - trio.current_time()), what="a KV pull")
            except ProtocolError as err:
                raise PullFailed("timeout", err.message) from None
            self._budget, self._held = budget, n

        t0 = time.perf_counter()
        try:
            with trio.fail_at(deadline):
                pulled = await pull_export(params, allow=settings.kv_pull_networks(), trace=self.trace, reserve=reserve)
        except trio.TooSlowError:
            exc = network_failure(
                "timeout", f"no KV from {params.host}:{params.port} within {settings.kv_pull_timeout_s:g} s"
            )
            self._fail(exc.reason, exc.detail)
            return None
        except PullFailed as exc:
            self._fail(exc.reason, exc.detail)
            return None
        self.pull_ms = (time.perf_counter() - t0) * 1000.0
        self.kv_bytes = len(pulled.blob)
        self.transport = pulled.transport
        self.exports.metrics.pull_bytes.inc(self.kv_bytes)
        # The admission: the identity gate again, on what the engine that served the bytes
        # says of itself, and the blob parsed (no more tokens than a slot holds).
        try:
            admitted = await engine.admit(pulled.blob, pulled.meta, lora=self.lora)
        except ProtocolError as err:
            self._fail_network("bad_reply", err.message)
            return None
        assert admitted.match is not None and admitted.blob is not None
        if admitted.match.lora_match is False:
            self._fail("lora_mismatch", "prefill engine made the export under another LoRA adapter set: "
                       f"{admitted.match.reason}")
            return None
        if not admitted.match.accepted:
            self._fail("identity_mismatch", f"prefill engine serves another model: {admitted.match.reason}")
            return None
        blob = admitted.blob
        if blob.n_past != params.n_past:
            self._fail_network("bad_reply", f"blob holds {blob.n_past} positions; the export announced {params.n_past}")
            return None
        return blob

    def _fail_network(self, cause: str, detail: str) -> None:
        exc = network_failure(cause, detail)
        self._fail(exc.reason, exc.detail)

    def _fail(self, reason: str, detail: str) -> None:
        """Fall back to a local prefill. The reply (and the metric) says only ``reason`` (a
        code): the detail can hold a peer's own words or tell a closed port from an open
        one, so it goes to the log alone (escaped there: observability/logs.py)."""
        self.status, self.reason, self.detail = "fallback", reason, detail
        self.exports.metrics.pulls.labels("fallback", reason).inc()
        log.info("KV hand-off falls back to a local prefill (%s): %s", reason, detail)

    def report(self) -> dict[str, Any]:
        """The ``kv_transfer`` field of the response (ours)."""
        out: dict[str, Any] = {"status": self.status}
        if self.params is not None:
            out["export_id"] = self.params.export_id
            out["source"] = f"{self.params.host}:{self.params.port}"
        if self.status == "fallback":
            out["reason"] = self.reason
        else:
            out["n_restored"] = self.n_restored
        if self.transport:
            out["transport"] = self.transport
        out.update(kv_bytes=self.kv_bytes, pull_ms=round(self.pull_ms, 3), restore_ms=round(self.restore_ms, 3))
        return out
