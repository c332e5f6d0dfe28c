"""The decode side of a P/D hand-off through a router's ``kv_transfer_params``.

``Handoff``: check the identity the export claims, then, in the request's
slot, pull it over the binary RPC (``pull.py``), check it (caps, hash, identity of
the serving engine, the prompt it holds), restore it and let the normal generation
continue from it. Any failure falls back to prefilling locally and says why (``report()``,
``hydra_kv_pulls_total{outcome="fallback",reason}``): the text is the same either way,
only the prompt work differs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from ..budget import ByteBudget
from ..config import Settings
from ..engine.engine import Engine
from ..engine.llama.seqstate import cache_layout_mismatch
from ..model.identity import compare_identity
from ..tasks import run_cpu_bound
from ..wire.errors import ProtocolError
from ..wire.kvblob import KvBlob, parse_kv_blob
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

    @classmethod
    def begin(cls, engine: Engine, exports: ExportStore, raw: object, *, trace: str = "") -> Handoff | None:
        """The hand-off a request's ``kv_transfer_params`` (``raw``) asks for: None when it
        names no hydra export; already a fallback when it is malformed or names KV of
        another model (the identity gate, before any byte moves)."""
        try:
            params = parse_handoff_params(raw)
        except ProtocolError as err:
            h = cls(None, exports, trace)
            h._fail("bad_params", err.message)
            return h
        if params is None:
            return None
        h = cls(params, exports, trace)
        match = compare_identity(engine.identity, params.identity, header_model=None)
        if not match.accepted:
            h._fail("identity_mismatch", f"export was made by another model: {match.reason}")
        elif (why := cache_layout_mismatch(params.kv_cache, engine.kv_cache_layout)) is not None:
            h._fail("layout_mismatch", f"export's KV cache layout differs: {why}")
        return h

    async def restore(
        self,
        engine: Engine,
        settings: Settings,
        budget: ByteBudget,
        slot_id: int,
        prompt_tokens: list[int],
        salt: str | None = None,
    ) -> None:
        """Pull the export and restore it into the caller's (claimed) slot (with the logits
        that came with it), as the history of the request's cache ``salt``. On any failure
        the slot is as it was and the request prefills locally.

        Runs in the request's slot, as a DECODE's receive does: the pulled bytes come from
        the payload budget (``--max-inflight-bytes``, shared with RPC payloads and uploads)
        and live only until the restore, and a client that leaves cancels the pull.
        ``--kv-pull-timeout-s`` bounds the wait for budget room and the pull together.

        The claim (``kv_bytes``, the client's number) is checked against --max-kv-bytes
        before any room is asked for: the budget's queue is first come, first served, and a
        claim it could never grant would hold everyone behind it until its deadline.

        A network failure (``pull_failed``) answers at the deadline, as a silent peer does:
        a closed port, a silent one and one that answers something else look the same."""
        if self.status != "pending" or self.params is None:
            return
        n = self.params.kv_bytes
        if n > settings.max_kv_bytes:
            self._fail("too_large", f"export of {n} bytes exceeds --max-kv-bytes {settings.max_kv_bytes}")
            return
        deadline = trio.current_time() + settings.kv_pull_timeout_s
        with trio.move_on_at(deadline) as wait:
            await budget.acquire(n)
        if wait.cancelled_caught:
            self._fail("timeout", f"no payload room for {n} bytes within {settings.kv_pull_timeout_s:g} s")
            return
        try:
            await self._pull_and_restore(engine, settings, deadline, slot_id, prompt_tokens, salt)
        finally:
            budget.release(n)
        if self.reason == PULL_FAILED:  # the budget is back; the slot waits, as for a silent peer
            await trio.sleep_until(deadline)

    async def _pull_and_restore(
        self,
        engine: Engine,
        settings: Settings,
        deadline: float,
        slot_id: int,
        prompt_tokens: list[int],
        salt: str | None,
    ) -> None:
        blob = await self._pull(engine, settings, deadline)
        if blob is None:
            return
        if blob.tokens != prompt_tokens[: len(blob.tokens)] or len(blob.tokens) > len(prompt_tokens):
            self._fail("prompt_mismatch", "the export holds another prompt than this request's")
            return
        t0 = time.perf_counter()
        try:
            await engine.kv.restore(slot_id, blob, salt=salt)
        except ProtocolError as err:
            self._fail("restore_failed", err.message)
            return
        self.restore_ms = (time.perf_counter() - t0) * 1000.0
        self.n_restored = blob.n_past
        self.status = "restored"
        self.exports.metrics.pulls.labels("restored", "").inc()

    async def _pull(self, engine: Engine, settings: Settings, deadline: float) -> KvBlob | None:
        params = self.params
        assert params is not None
        t0 = time.perf_counter()
        try:
            with trio.fail_at(deadline):
                pulled = await pull_export(params, allow=settings.kv_pull_networks(), trace=self.trace)
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
        # The identity gate again, on what the engine that served the bytes says of itself.
        match = compare_identity(engine.identity, pulled.meta, header_model=None)
        if not match.accepted:
            self._fail("identity_mismatch", f"prefill engine serves another model: {match.reason}")
            return None
        try:
            # No more tokens than a slot holds: the token list is built from the blob's count.
            parse = partial(parse_kv_blob, pulled.blob, max_tokens=engine.n_ctx_slot)
            blob = await run_cpu_bound(parse, len(pulled.blob))
        except ProtocolError as err:
            self._fail_network("bad_reply", err.message)
            return None
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
        one, so it goes to the log alone (escaped there: logs.py)."""
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
