"""The decode request lifecycle (spec §4.3).

Each accepted DECODE is one task in the manager's nursery with its own cancel scope:
validate -> restore (GPU worker, under the validation deadline) -> ack the RPC caller ->
tokenize + prefill the prompt delta -> token loop -> done | failed | cancelled | timed_out.
The slot is held from validate until the task ends, however it ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from ..engine.engine import Engine, GenerationResult
from ..engine.params import GenerationParams, parse_generation
from ..engine.worker import CallTiming
from ..model.identity import IdentityMatch, compare_identity
from ..tasks import OwnedTask
from ..wire.errors import ErrorCode, ProtocolError, Status
from ..wire.frames import DecodeFrame, merged_generation
from ..wire.kvblob import KvBlob, parse_kv_blob
from .store import DecodeEntry, DecodeState, ResultStore, Tombstone

if TYPE_CHECKING:
    from ..app import AppState
    from ..engine.slots import Slot

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Ack:
    """What the request task tells the waiting RPC handler once restore is over."""

    done: trio.Event = field(default_factory=trio.Event)
    meta: dict[str, Any] | None = None
    error: ProtocolError | None = None


class DecodeManager:
    def __init__(self, state: AppState, engine: Engine, store: ResultStore) -> None:
        self.state = state
        self.engine = engine
        self.store = store
        self.settings = state.settings
        self._nursery: trio.Nursery | None = None
        self._accepting = True
        self.drained = trio.Event()
        self._t3_seen = engine.t3_reloads

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._sweeper)
            task_status.started()
            await trio.sleep_forever()

    async def _sweeper(self) -> None:
        # Expiry also happens on every store access; this keeps memory bounded when idle.
        period = max(0.5, min(30.0, self.store.ttl_s / 4))
        while True:
            await trio.sleep(period)
            self.store.sweep()

    async def drain(self, grace_s: float) -> None:
        """Shutdown: refuse new requests, give running ones ``grace_s`` to finish, then
        cancel the rest and wait until they stopped."""
        self._accepting = False
        with trio.move_on_after(grace_s):
            while self.store.running():
                entry = self.store.running()[0]
                if entry.task is not None:
                    await entry.task.finished.wait()
                else:
                    await trio.sleep(0.01)
        for entry in self.store.running():
            if entry.task is not None:
                await entry.task.cancel_and_wait()
        self.drained.set()

    # ---- submit (RPC) ------------------------------------------------------------------

    async def submit(self, slot_id: int, frame: DecodeFrame, *, trace: str, rlog: Any) -> dict[str, Any]:
        """Validate, restore and start a decode request; return the OK meta.

        Raises ProtocolError for any refusal. If the caller is cancelled (its connection
        closed) before the ack, the request is cancelled and becomes a tombstone.
        """
        if not self._accepting or self._nursery is None:
            raise ProtocolError(ErrorCode.SLOT_BUSY, "engine is shutting down", status=Status.BUSY)
        t0 = time.perf_counter()
        engine = self.engine
        engine.slots.get(slot_id)  # NO_SLOT
        request = {**engine.slot_generation_defaults(slot_id), **merged_generation(frame)}
        params = parse_generation(request, default_n_predict=self.settings.default_n_predict, n_ctx=engine.n_ctx)
        prompt_text = await engine.render_prompt(request)  # a malformed prompt is refused before the reply
        blob = parse_kv_blob(frame.kv) if len(frame.kv) else None
        slot = engine.slot_claim(slot_id, f"decode:{trace or 'rpc'}")  # SLOT_BUSY
        try:
            entry = self.store.create(slot_id)  # RESULT_STORE_FULL before anything is written
        except BaseException:
            engine.release(slot)
            raise
        entry.metrics["kv_bytes"] = len(frame.kv)
        match = self._identity_gate(frame, blob)
        entry.metrics["validate_ms"] = (time.perf_counter() - t0) * 1000.0
        entry.metrics["match"] = match.as_meta()
        if not match.accepted:
            engine.release(slot)
            entry.error, entry.error_code = match.reason, ErrorCode.CAP_MISMATCH
            self.store.finish(entry, DecodeState.FAILED)
            self.state.metrics.decode_requests.labels("rejected").inc()
            raise ProtocolError(
                ErrorCode.CAP_MISMATCH,
                f"KV does not match the resident model: {match.reason}",
                extra={"valid": False, "match": match.as_meta(), "decode_request_id": entry.id, "reason": match.reason},
            )
        ack = _Ack()
        task = OwnedTask(f"decode:{entry.id}")
        entry.task = task
        self._nursery.start_soon(self._run_request, entry, slot, blob, prompt_text, params, ack, t0, rlog)
        try:
            await ack.done.wait()
        except trio.Cancelled:
            # Nobody will learn this id: the request must not run on.
            with trio.CancelScope(shield=True):
                await task.cancel_and_wait()
            raise
        if ack.error is not None:
            raise ack.error
        assert ack.meta is not None
        self.state.metrics.decode_ack_ms.observe((time.perf_counter() - t0) * 1000.0)
        return ack.meta

    def _identity_gate(self, frame: DecodeFrame, blob: KvBlob | None) -> IdentityMatch:
        resident = self.engine.identity
        kv_meta = frame.header.get("kv_metadata")
        if blob is None and not kv_meta:
            # No foreign KV and no claims about it: the slot's KV is this engine's own.
            kv_meta = resident.fields()
        header_model = frame.header.get("model")
        return compare_identity(resident, kv_meta, header_model=header_model if isinstance(header_model, str) else None)

    # ---- the request task --------------------------------------------------------------

    async def _run_request(
        self,
        entry: DecodeEntry,
        slot: Slot,
        blob: KvBlob | None,
        prompt_text: str,
        params: GenerationParams,
        ack: _Ack,
        t0: float,
        rlog: Any,
    ) -> None:
        engine = self.engine
        task: OwnedTask = entry.task
        final = DecodeState.FAILED
        try:
            with task.scope:
                logits = await self._restore_phase(entry, slot, blob, ack, t0)
                del blob  # the blob is a view of the RPC payload: let that buffer go now
                if logits is _TIMED_OUT:
                    final = DecodeState.TIMED_OUT
                    return
                final = await self._generate_phase(entry, prompt_text, params, logits, rlog)
            if task.scope.cancelled_caught:
                final = DecodeState.CANCELLED
        except trio.Cancelled:  # shutdown: the manager's nursery is being cancelled
            final = DecodeState.CANCELLED
            raise
        except ProtocolError as err:
            entry.error, entry.error_code = err.message, str(err.code)
            rlog.info("decode %d failed: %s", entry.id, err.message)
            if not ack.done.is_set():
                ack.error = _with_id(err, entry)
        except Exception as exc:
            rlog.exception("decode %d failed", entry.id)
            entry.error, entry.error_code = f"internal error: {type(exc).__name__}: {exc}", ErrorCode.INTERNAL
            if not ack.done.is_set():
                ack.error = _with_id(ProtocolError(ErrorCode.INTERNAL, entry.error), entry)
        finally:
            engine.release(slot)
            if final == DecodeState.CANCELLED and not ack.done.is_set():
                ack.error = _with_id(
                    ProtocolError(ErrorCode.RESTORE_FAILED, "decode request cancelled before the restore completed"),
                    entry,
                    state=DecodeState.CANCELLED,
                )
            self._seal(entry, final)
            ack.done.set()
            task.finished.set()

    async def _restore_phase(
        self, entry: DecodeEntry, slot: Slot, blob: KvBlob | None, ack: _Ack, t0: float
    ) -> Any:
        engine = self.engine
        entry.state = DecodeState.RESTORING
        entry.notify()
        t_restore = time.perf_counter()
        logits = None
        timing = CallTiming()
        with trio.move_on_after(self.settings.decode_validate_timeout_s - (t_restore - t0)) as deadline:
            if blob is not None:
                slot.transferring = True
                logits = await engine.state_restore(slot.id, blob, timing)
                slot.transferring = False
                self.state.metrics.restore_bytes.inc(entry.metrics["kv_bytes"])
        if deadline.cancelled_caught:
            # The restore was cancelled (queued or aborted before commit): the slot holds
            # exactly what it held before, and nothing will run for this id.
            ack.error = _with_id(
                ProtocolError(ErrorCode.TIMEOUT, "validation timeout"), entry, state=DecodeState.TIMED_OUT
            )
            return _TIMED_OUT
        m = entry.metrics
        m["restore_slot_ms"] = (time.perf_counter() - t_restore) * 1000.0
        m["queue_wait_ms"] = timing.queue_wait_s * 1000.0
        m["n_past_after_restore"] = engine.n_past(slot.id)
        t3 = engine.t3_reloads
        m["t3_reloaded"] = t3 != self._t3_seen
        m["t3_reload_ms"] = engine.last_t3_reload_ms if t3 != self._t3_seen else 0.0
        self._t3_seen = t3
        entry.state = DecodeState.GENERATING
        entry.metrics["decode_init_ms"] = (time.perf_counter() - t0) * 1000.0 - m["restore_slot_ms"] - m["validate_ms"]
        ack.meta = {
            "valid": True,
            "match": m["match"],
            "decode_request_id": entry.id,
            "n_past_after_restore": m["n_past_after_restore"],
            "restore_slot_ms": round(m["restore_slot_ms"], 3),
            "decode_init_ms": round(m["decode_init_ms"], 3),
            "kv_bytes": m["kv_bytes"],
            "id_slot": slot.id,
        }
        entry.metrics["acked_at"] = time.perf_counter()
        ack.done.set()
        entry.notify()
        return logits

    async def _generate_phase(
        self, entry: DecodeEntry, prompt_text: str, params: GenerationParams, logits: Any, rlog: Any
    ) -> DecodeState:
        engine = self.engine
        tokens = await engine.tokenize_text(prompt_text)
        res = GenerationResult()
        entry.result = res

        async def emit(delta: str) -> None:
            entry.chunks.append(delta)
            entry.notify()

        await engine.generate(entry.slot_id, tokens, params, emit, logits=logits, result=res)
        entry.metrics["n_past"] = engine.n_past(entry.slot_id)
        rlog.info(
            "decode %d done: %d prompt (%d cached), %d generated, %s, %.1f tok/s",
            entry.id,
            res.prompt_tokens,
            res.n_common,
            res.completion_tokens,
            res.stop_type,
            res.tokens_per_s,
        )
        return DecodeState.DONE

    def _seal(self, entry: DecodeEntry, final: DecodeState) -> None:
        res: GenerationResult | None = entry.result
        if res is not None:
            acked = entry.metrics.get("acked_at")
            self.state.record_generation("decode", res)
            m = entry.metrics
            if acked is not None and res.first_token_at is not None:
                m["ttft_ms"] = (res.first_token_at - acked) * 1000.0
        self.store.finish(entry, final)
        self.state.metrics.decode_requests.labels(final.value).inc()

    # ---- HTTP side ---------------------------------------------------------------------

    def lookup(self, request_id: int) -> DecodeEntry | Tombstone | None:
        return self.store.get(request_id)

    async def cancel(self, request_id: int) -> tuple[int, dict[str, Any]]:
        """DELETE: cancel and wait for the task to stop; or delete a finished entry."""
        found = self.store.get(request_id)
        if found is None:
            return 404, {"error": "no such decode request", "decode_request_id": request_id}
        if isinstance(found, Tombstone):
            return 410, {"state": found.state.value, "decode_request_id": request_id}
        entry = found
        if entry.running and entry.task is not None:
            t0 = time.perf_counter()
            await entry.task.cancel_and_wait()
            self.state.metrics.cancel_ms.observe((time.perf_counter() - t0) * 1000.0)
            state = entry.state
            if state == DecodeState.CANCELLED:
                res: GenerationResult | None = entry.result
                return 200, {
                    "cancelled": True,
                    "decode_request_id": request_id,
                    "state": "cancelled",
                    # ours: what the request had computed when it stopped, and the engine's
                    # work counter at this moment (compare later: nothing ran after the reply)
                    "completion_tokens": res.completion_tokens if res else 0,
                    "engine_tokens_evaluated": self.engine.tokens_evaluated,
                }
            # It finished on its own before the cancellation landed: now delete it.
        self.store.delete(entry)
        return 200, {"cancelled": False, "decode_request_id": request_id, "state": "deleted"}

    def hydra_metrics(self, entry: DecodeEntry) -> dict[str, Any]:
        res: GenerationResult | None = entry.result
        m = entry.metrics
        engine = self.engine
        n_common = res.n_common if res else 0
        return {
            "decode_request_id": entry.id,
            "id_slot": entry.slot_id,
            "n_past": m.get("n_past", m.get("n_past_after_restore", 0)),
            "decode_ms": round(res.decode_ms, 3) if res else 0.0,
            "prompt_ms": round(res.prompt_ms, 3) if res else 0.0,
            "model_load_ms": round(engine.model_load_ms, 3),
            "restore_slot_ms": round(m.get("restore_slot_ms", 0.0), 3),
            "model_identity": engine.identity.fields(),
            "match": m.get("match", {}),
            # True when the KV carried in could not serve the prompt at all and it was
            # recomputed from scratch.
            "model_fallback": bool(m.get("kv_bytes") and res is not None and n_common == 0 and not res.logits_reused),
            "n_common": n_common,
            "n_prompt_processed": res.n_prompt_processed if res else 0,
            "logits_reused": res.logits_reused if res else False,
            "kv_bytes": m.get("kv_bytes", 0),
            "t3_reloaded": m.get("t3_reloaded", False),
            "t3_reload_ms": round(m.get("t3_reload_ms", 0.0), 3),
            "decode_init_ms": round(m.get("decode_init_ms", 0.0), 3),
            "validate_ms": round(m.get("validate_ms", 0.0), 3),
            "queue_wait_ms": round(m.get("queue_wait_ms", 0.0), 3),
            "ttft_ms": round(m.get("ttft_ms", 0.0), 3),
            "tokens_per_s": round(res.tokens_per_s, 3) if res else 0.0,
            "stop_type": res.stop_type if res else "",
        }


class _TimedOut:
    pass


_TIMED_OUT = _TimedOut()


def _with_id(err: ProtocolError, entry: DecodeEntry, state: DecodeState | None = None) -> ProtocolError:
    extra = {**err.extra, "decode_request_id": entry.id}
    if state is not None:
        extra["state"] = state.value
    return ProtocolError(err.code, err.message, status=err.status, extra=extra)
