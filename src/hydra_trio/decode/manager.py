"""The decode request lifecycle (spec §4.3).

One DECODE is one task, started by its caller with ``nursery.start(manager.run_request,
...)``: validation and restore run under the caller's scope (a caller that goes away
cancels them), every refusal reaches the caller as a ``ProtocolError``, and
``task_status.started(handle)`` hands over the reply meta. From then on the task lives in
the manager's nursery and generates; the caller writes the reply and calls
``handle.commit()``, or ``handle.abandon()`` if the reply could not be written, which
cancels the request (nobody holds its id). The slot is held from validation until the task
ends, however it ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import trio

from ..concurrency import OwnedTask
from ..config import Settings
from ..engine import (
    CallTiming,
    Engine,
    GenerationParams,
    GenerationResult,
    SlotLease,
    Turn,
    turn_receipt,
)
from ..model.identity import IdentityMatch
from ..observability import Metrics, generation_fields, receipt_note, request_extra, spec_note
from ..wire.agentic import session_hint
from ..wire.errors import ErrorCode, ProtocolError, Status
from ..wire.frames import DecodeFrame, merged_generation
from ..wire.kvblob import KvBlob
from .store import DecodeEntry, DecodeState, ResultStore, Tombstone

log = logging.getLogger(__name__)

RPC_TENANT = "rpc"  # DECODEs' agent sessions: RPC peers are one trust domain (--rpc-allow)


def _no_header(_name: str) -> str | None:
    return None  # a DECODE names its session in its generation (vllm_xargs, prompt_cache_key)


@dataclass(slots=True)
class StartedDecode:
    """A validated, restored DECODE: the OK meta to send, and the request to commit once the
    reply is written, or to abandon if it was not."""

    meta: dict[str, Any]
    entry: DecodeEntry
    store: ResultStore
    metrics: Metrics
    started_at: float  # perf_counter() when validation began

    def commit(self) -> None:
        """The caller holds the id: the request is theirs to read or DELETE."""
        self.metrics.decode_ack.observe(time.perf_counter() - self.started_at)

    async def abandon(self) -> None:
        """The reply was not written: cancel the request and wait until it stopped; it
        becomes a ``cancelled`` tombstone."""
        task: OwnedTask = self.entry.task
        await task.cancel_and_wait()
        # A short request may have finished while the server learned the peer was gone.
        self.store.forget_unclaimed(self.entry)


class CancelOutcome(StrEnum):
    UNKNOWN = "unknown"  # no such id (never existed, or forgotten)
    ENDED = "ended"  # already a tombstone
    CANCELLED = "cancelled"  # was running; its task has stopped
    DELETED = "deleted"  # had finished; its result was removed


@dataclass(frozen=True, slots=True)
class CancelResult:
    outcome: CancelOutcome
    request_id: int
    state: DecodeState | None = None
    completion_tokens: int = 0  # what the request had generated when it stopped
    receipt: dict[str, Any] | None = None  # what it computed and left (engine/receipts.py)


class DecodeManager:
    def __init__(self, engine: Engine, store: ResultStore, settings: Settings, metrics: Metrics) -> None:
        self.engine = engine
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self._nursery: trio.Nursery | None = None
        self._accepting = True
        # Requests outlive the front ends that start them: cancelling the owner does not
        # reach them; ``stop()`` ends them once the front ends have left.
        self._lifetime = trio.CancelScope(shield=True)
        self._t3_seen = engine.stats().t3_reloads

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self._lifetime:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._sweeper)
                task_status.started()
                await trio.sleep_forever()

    @property
    def nursery(self) -> trio.Nursery:
        """Where requests live once started: ``await manager.nursery.start(run_request...)``."""
        if self._nursery is None:
            raise RuntimeError("the decode manager is not running")
        return self._nursery

    async def stop(self) -> None:
        """Cancel every running request, wait until each has stopped, and end ``run``."""
        self.close_to_new()
        try:
            await self.cancel_all()
        finally:
            self._lifetime.cancel()

    async def _sweeper(self) -> None:
        # Expiry also happens on every store access; this keeps memory bounded when idle.
        period = max(0.5, min(30.0, self.store.ttl_s / 4))
        while True:
            await trio.sleep(period)
            self.store.sweep()

    # ---- shutdown (the caller chooses the grace period) --------------------------------

    def close_to_new(self) -> None:
        """Refuse new DECODEs (BUSY) from now on."""
        self._accepting = False

    async def cancel_all(self) -> None:
        for entry in self.store.running():
            await entry.task.cancel_and_wait()

    # ---- the life of one request --------------------------------------------------------

    async def run_request(
        self,
        slot_id: int,
        frame: DecodeFrame,
        *,
        trace: str,
        rlog: logging.LoggerAdapter | logging.Logger,  # type: ignore[type-arg]
        task_status: trio.TaskStatus[StartedDecode] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Validate, restore, hand the reply meta to the caller, generate (spec §4.3).

        Start it with ``nursery.start``. Until ``task_status.started`` it runs under the
        caller's scope and every refusal is raised to the caller; after it, it runs in the
        manager's nursery and its end (done, failed, cancelled) is written to its entry.
        """
        t0 = time.perf_counter()
        deadline = trio.current_time() + self.settings.decode_validate_timeout_s
        if not self._accepting or self._nursery is None:
            raise ProtocolError(ErrorCode.SLOT_BUSY, "engine is draining for shutdown")
        engine = self.engine
        engine.slot_info(slot_id)  # NO_SLOT
        try:
            with trio.fail_at(deadline):  # the validation deadline covers these waits too
                # The one request policy, over the slot's CONFIGURE T1 layer, the header's
                # generation and the prompt segment: what HTTP refuses is refused here, a
                # grammar that cannot compile is a 400, a malformed prompt is refused before
                # the reply. No prompt at all (an empty prompt segment, spec §4.1): decoding
                # continues from what the slot holds.
                merged = merged_generation(frame)
                prepared = await engine.prepare("decode", merged, slot=slot_id, tokenize=False)
                # Its agent session, as its generation names it (RPC peers are one tenant).
                hint = session_hint(_no_header, merged)
                # The KV's admission: parsed (no longer than a slot) and held against the
                # resident model by what the coordinator claims of it (§4.2).
                # Foreign KV (or claims about it) must have been made under the request's LoRA
                # adapter set; the slot's own KV is held to it by the slot's history (prefix reuse).
                claims, own = self._claims(frame)
                admitted = await engine.admit(
                    frame.kv if len(frame.kv) else None, claims, header_model=_header_model(frame),
                    lora=None if own else prepared.params.lora,
                )
        except trio.TooSlowError:
            raise ProtocolError(ErrorCode.TIMEOUT, "validation timeout") from None
        params, prompt_text = prepared.params, prepared.prompt
        entry: DecodeEntry | None = None
        final, label = DecodeState.FAILED, None
        started: StartedDecode | None = None
        turn: Turn | None = None
        try:
            async with (
                engine.sessions(RPC_TENANT).turn(hint, params.cache_salt) as turn,
                # SLOT_BUSY
                engine.claim(f"decode:{trace or 'rpc'}", slot=slot_id, lora=params.lora, turn=turn) as lease,
            ):
                entry = self.store.create(slot_id)  # RESULT_STORE_FULL before anything is written
                entry.task = task = OwnedTask(f"decode:{entry.id}")
                entry.turn = turn
                entry.replies = prepared.replies
                entry.logprobs = params.logprobs is not None
                entry.metrics.kv_bytes = len(frame.kv)
                blob = admitted.blob
                try:
                    with task.scope:  # DELETE and abandon() cancel this scope
                        self._check_identity(entry, admitted.match, t0)
                        try:
                            with trio.fail_at(deadline):
                                await self._restore(entry, lease, blob, params)
                        except trio.TooSlowError:
                            # The restore was cancelled (queued or aborted before commit): the slot
                            # holds exactly what it held before, and nothing runs for this id.
                            final = DecodeState.TIMED_OUT
                            raise ProtocolError(ErrorCode.TIMEOUT, "validation timeout") from None
                        # Views of the RPC payload: let that buffer go now (the budget has released
                        # it once the reply is written; a reference here would keep it for the whole
                        # generation).
                        del blob, frame, admitted
                        if prompt_text is None and lease.n_past == 0:
                            raise ProtocolError(
                                ErrorCode.BAD_JSON,
                                "DECODE has no prompt, and the slot holds no KV to continue from",
                                status=Status.BAD_REQUEST,
                            )
                        started = self._started(entry, slot_id, t0)
                        task_status.started(started)
                        final = await self._generate(entry, lease, prompt_text, params, rlog)
                    if task.scope.cancelled_caught:
                        final = DecodeState.CANCELLED
                        turn.cut = turn.cut or "delete"
                        turn.cancel_subagents()  # its tree ends with it
                        if started is None:  # DELETE during validation or restore
                            raise ProtocolError(ErrorCode.RESTORE_FAILED, "decode request cancelled "
                                                "before the restore completed")
                except trio.Cancelled:  # the caller left before the reply, or the engine stops
                    final = DecodeState.CANCELLED
                    raise
                except ProtocolError as err:
                    entry.error, entry.error_code = err.message, str(err.code)
                    if err.code == ErrorCode.CAP_MISMATCH:
                        label = "rejected"
                    if started is None:
                        raise _with_id(err, entry, final) from None
                    # Its request line (below) names the cause.
                except Exception as exc:
                    entry.error, entry.error_code = f"internal error: {type(exc).__name__}: {exc}", ErrorCode.INTERNAL
                    if started is None:
                        raise _with_id(ProtocolError(ErrorCode.INTERNAL, entry.error), entry, final) from exc
                    rlog.exception("decode %d failed", entry.id)
            if turn.cut is not None and started is None:  # cut (deadline, its tree) before its reply
                err = ProtocolError(ErrorCode.TIMEOUT, f"decode request cut before it started ({turn.cut})")
                raise err if entry is None else _with_id(err, entry, DecodeState.CANCELLED)
        finally:
            if entry is not None:  # the slot is free by now
                if turn is not None and turn.cut is not None:
                    final = DecodeState.CANCELLED
                    if entry.result is not None:
                        entry.result.cut, entry.result.stop_type = turn.cut, "cancelled"
                self._seal(entry, final, label)
                if started is not None:
                    self._log_end(entry, final, trace, rlog, params.lora_name)
                entry.task.finished.set()

    def _claims(self, frame: DecodeFrame) -> tuple[Any, bool]:
        """What the coordinator claims of the model that made the KV (``kv_metadata``), and
        whether the KV is the slot's own: with no foreign KV and no claims, it is this
        engine's."""
        kv_meta = frame.header.get("kv_metadata")
        if not len(frame.kv) and not kv_meta:
            resident = self.engine.identity
            return resident.fields(), True
        # KV with no claims about it is checked as claiming nothing (a CAP_MISMATCH naming
        # each missing field), never taken on trust.
        return ({} if kv_meta is None else kv_meta), False

    def _check_identity(self, entry: DecodeEntry, match: IdentityMatch | None, t0: float) -> None:
        """The §4.2 identity gate's verdict (``Engine.admit``); CAP_MISMATCH if it failed."""
        assert match is not None, "DECODE always gives claims (_claims)"
        entry.metrics.match = match.as_meta()
        entry.metrics.validate_ms = (time.perf_counter() - t0) * 1000.0
        if not match.accepted:
            raise ProtocolError(
                ErrorCode.CAP_MISMATCH,
                f"KV does not match the resident model: {match.reason}",
                extra={"valid": False, "match": match.as_meta(), "reason": match.reason},
            )

    async def _restore(
        self, entry: DecodeEntry, lease: SlotLease, blob: KvBlob | None, params: GenerationParams
    ) -> None:
        """Restore the blob into the slot (all-or-nothing), with the logits that came with it."""
        entry.state = DecodeState.RESTORING
        entry.notify()
        t_restore = time.perf_counter()
        if blob is not None:
            await lease.restore(blob, timing=(timing := CallTiming()), salt=params.cache_salt, lora=params.lora)
            entry.metrics.queue_wait_ms = timing.queue_wait_s * 1000.0
            self.metrics.restore_bytes.inc(entry.metrics.kv_bytes)
        m = entry.metrics
        m.restore_slot_ms = (time.perf_counter() - t_restore) * 1000.0
        m.n_past_after_restore = lease.n_past
        stats = self.engine.stats()
        t3 = stats.t3_reloads
        m.t3_reloaded = t3 != self._t3_seen
        m.t3_reload_ms = stats.last_t3_reload_ms if t3 != self._t3_seen else 0.0
        self._t3_seen = t3

    def _started(self, entry: DecodeEntry, slot_id: int, t0: float) -> StartedDecode:
        m = entry.metrics
        m.decode_init_ms = (time.perf_counter() - t0) * 1000.0 - m.restore_slot_ms - m.validate_ms
        m.acked_at = time.perf_counter()
        entry.state = DecodeState.GENERATING
        entry.notify()
        meta = {
            "valid": True,
            "match": m.match,
            "decode_request_id": entry.id,
            "n_past_after_restore": m.n_past_after_restore,
            "restore_slot_ms": round(m.restore_slot_ms, 3),
            "decode_init_ms": round(m.decode_init_ms, 3),
            "kv_bytes": m.kv_bytes,
            "id_slot": slot_id,
        }
        return StartedDecode(meta, entry, self.store, self.metrics, t0)

    async def _generate(
        self, entry: DecodeEntry, lease: SlotLease, prompt_text: str | None, params: GenerationParams, rlog: Any
    ) -> DecodeState:
        if prompt_text is None:  # continue the slot: its tokens are the prompt
            tokens = lease.tokens()
        else:
            tokens = await self.engine.prompt_tokens(prompt_text)
        res = GenerationResult()
        entry.result = res

        async def emit(delta: str) -> None:
            entry.chunks.append(delta)
            entry.notify()

        await lease.generate(tokens, params, emit, result=res)
        entry.metrics.n_past = lease.n_past
        return DecodeState.DONE

    def _log_end(self, entry: DecodeEntry, final: DecodeState, trace: str, rlog: Any, lora: str | None) -> None:
        """The DECODE's request line, however it ended (after its reply: a refusal before
        it is the RPC server's line), with the LoRA adapter set it ran under (``lora``)."""
        res: GenerationResult = entry.result or GenerationResult()
        outcome = final.value  # done | failed | cancelled
        fields = generation_fields(res, outcome=outcome)
        if final is DecodeState.DONE:
            detail = f"{res.stop_type}, {res.tokens_per_s:.1f} tok/s{spec_note(res)}"
        else:
            detail = entry.error or "-"
        receipt = turn_receipt(res)
        session = "" if res.session_id is None else f", session {res.session_id}"
        rlog.info(
            "decode %d %s: %d prompt (%d cached), %d generated, %s%s%s%s",
            entry.id, outcome, res.prompt_tokens, res.n_common, res.completion_tokens, detail,
            "" if lora is None else f", LoRA {lora}", session, receipt_note(receipt),
            extra=request_extra(
                request_id=trace or f"decode-{entry.id}", route="decode", model=self.engine.served_name,
                slot=entry.slot_id,
                error=entry.error or None, lora=lora, session_id=res.session_id, receipt=receipt, **fields,
            ),
        )

    def _seal(self, entry: DecodeEntry, final: DecodeState, label: str | None) -> None:
        res: GenerationResult | None = entry.result
        if res is not None:
            self.metrics.record_generation(
                "decode", res, model=self.engine.served_name, aborted=final is DecodeState.CANCELLED
            )
            acked = entry.metrics.acked_at
            if acked is not None and res.first_token_at is not None:
                entry.metrics.ttft_ms = (res.first_token_at - acked) * 1000.0
        self.store.finish(entry, final)
        self.metrics.decode_requests.labels(label or final.value).inc()

    # ---- readers and DELETE -------------------------------------------------------------

    def lookup(self, request_id: int) -> DecodeEntry | Tombstone | None:
        return self.store.get(request_id)

    async def cancel(self, request_id: int) -> CancelResult:
        """DELETE: cancel a running request and wait until its task stopped; or remove a
        finished one's result."""
        found = self.store.get(request_id)
        if found is None:
            return CancelResult(CancelOutcome.UNKNOWN, request_id)
        if isinstance(found, Tombstone):
            return CancelResult(CancelOutcome.ENDED, request_id, found.state)
        entry = found
        if entry.running:
            t0 = time.perf_counter()
            if entry.turn is not None:  # its subagents stop in the same pass as it does
                entry.turn.cancel_subagents()
            await entry.task.cancel_and_wait()
            self.metrics.cancel.observe(time.perf_counter() - t0)
            if entry.state == DecodeState.CANCELLED:
                res: GenerationResult | None = entry.result
                return CancelResult(
                    CancelOutcome.CANCELLED,
                    request_id,
                    entry.state,
                    completion_tokens=res.completion_tokens if res else 0,
                    receipt=turn_receipt(res) if res else None,
                )
            # It finished on its own before the cancellation landed: now delete it.
        self.store.delete(entry)
        return CancelResult(CancelOutcome.DELETED, request_id, DecodeState.DELETED)


def _header_model(frame: DecodeFrame) -> str | None:
    model = frame.header.get("model")
    return model if isinstance(model, str) else None


def _with_id(err: ProtocolError, entry: DecodeEntry, state: DecodeState) -> ProtocolError:
    """The refusal the caller sees: it names the request id (and its end state, when the
    request became a tombstone) so the coordinator can correlate it."""
    extra = {**err.extra, "decode_request_id": entry.id}
    if state in (DecodeState.TIMED_OUT, DecodeState.CANCELLED):
        extra["state"] = state.value
    return ProtocolError(err.code, err.message, status=err.status, extra=extra)
