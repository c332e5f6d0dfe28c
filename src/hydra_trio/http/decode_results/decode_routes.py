"""GET /v1/decode/{id} (SSE or JSON) and DELETE /v1/decode/{id} (spec §6.1, §6.2)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Blueprint, Response, request

from ...concurrency import Wrote
from ...decode.manager import CancelOutcome, DecodeManager
from ...decode.store import DecodeEntry, DecodeState, Tombstone
from ...engine import Engine, GenerationResult, turn_receipt
from ...wire.protocol import ascii_decimal
from ..completions import ReplyEvents, completion_body, completion_chunk, final_chunk
from ..plumbing import (
    HOLE,
    SSE_DONE,
    EngineStarting,
    HttpError,
    app_state,
    chunk_writer,
    error_body,
    json_response,
    require_engine,
    sse_event,
    sse_text_events,
    wants_sse,
)

bp = Blueprint("decode", __name__)

MAX_WAIT_S = 600.0


def _manager() -> DecodeManager:
    require_engine()
    manager = app_state().decodes
    if manager is None:
        raise EngineStarting
    return manager


def _request_id(raw: str) -> int:
    # ASCII digits only (int() takes '²', ' 7', '1_0'); ids are positive int32, so a sign or
    # more than 10 digits names none.
    rid = ascii_decimal(raw, max_digits=10)
    if rid is None:
        raise HttpError(400, "decode_request_id must be an integer in ASCII digits, got "
                        f"{raw[:40]!r}", "invalid_request_error")
    return rid


@bp.get("/v1/decode")
async def list_decodes() -> Response:
    """Ours: the entries the store holds (ids, states, slots), newest last."""
    manager = _manager()
    return json_response(
        [{"decode_request_id": e.id, "state": e.state.value, "id_slot": e.slot_id} for e in manager.store.entries()]
    )


@bp.get("/v1/decode/<raw_id>")
async def get_decode(raw_id: str) -> Response:
    manager = _manager()
    request_id = _request_id(raw_id)
    found = manager.lookup(request_id)
    if found is None:
        return json_response(
            error_body(404, "no such decode request", "not_found_error", decode_request_id=request_id), 404
        )
    if isinstance(found, Tombstone):
        ended: dict[str, Any] = {"state": found.state.value, "decode_request_id": request_id}
        if found.receipt is not None:  # a cut request's: what it computed and what stays
            ended["receipt"] = found.receipt
        return json_response(ended, 410)
    entry: DecodeEntry = found
    if entry.state in (DecodeState.VALIDATING, DecodeState.RESTORING):
        return json_response({"state": entry.state.value, "decode_request_id": entry.id, "id_slot": entry.slot_id}, 202)
    if entry.state == DecodeState.FAILED:
        return _failed(entry)
    if wants_sse(request.headers.get("Accept")):
        return Response(
            _sse_stream(manager, entry),
            status=200,
            content_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    if entry.running:
        wait_s = _wait_param()
        if wait_s > 0:
            await _wait_finished(entry, wait_s)
    if entry.state == DecodeState.DONE:
        return json_response(_result_body(manager, entry))
    if entry.state == DecodeState.FAILED:
        return _failed(entry)
    if entry.running:
        return json_response(
            # docs/rpc-protocol.md §6.1 fixes this compat body key for key (coordinators retry on it).
            {
                "error": {"code": 404, "message": "decode_request_id not ready", "type": "not_ready"},
                "state": entry.state.value,
            },
            404,
            headers={"Retry-After": "1"},
        )
    return json_response({"state": entry.state.value, "decode_request_id": entry.id}, 410)


@bp.delete("/v1/decode/<raw_id>")
async def delete_decode(raw_id: str) -> Response:
    manager = _manager()
    request_id = _request_id(raw_id)
    result = await manager.cancel(request_id)
    if result.outcome == CancelOutcome.UNKNOWN:
        return json_response(
            error_body(404, "no such decode request", "not_found_error", decode_request_id=request_id), 404
        )
    state = result.state.value if result.state is not None else ""
    if result.outcome == CancelOutcome.ENDED:
        return json_response({"state": state, "decode_request_id": request_id}, 410)
    if result.outcome == CancelOutcome.DELETED:
        return json_response({"cancelled": False, "decode_request_id": request_id, "state": state})
    return json_response(
        {
            "cancelled": True,
            "decode_request_id": request_id,
            "state": state,
            # ours: what the request had computed when it stopped, and the engine's work
            # counter at this moment (compare later: nothing ran after the reply)
            "completion_tokens": result.completion_tokens,
            "engine_tokens_evaluated": require_engine().stats().tokens_evaluated,
            "receipt": result.receipt,
        }
    )


def _wait_param() -> float:
    raw = request.args.get("wait")
    if raw is None:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        return 0.0
    return min(max(value, 0.0), MAX_WAIT_S)


async def _wait_finished(entry: DecodeEntry, wait_s: float) -> None:
    with trio.move_on_after(wait_s):  # the ?wait bound; then the reply says where it stands
        await entry.wait_ended()


def _failed(entry: DecodeEntry) -> Response:
    return json_response(
        {
            **error_body(400, entry.error or "decode failed", "decode_failed"),
            "error_code": "DECODE_FAILED",
            "reason_code": entry.error_code,
        },
        400,
    )


def _completion_id(entry: DecodeEntry) -> str:
    return f"chatcmpl-decode-{entry.id}"


def _result_body(manager: DecodeManager, entry: DecodeEntry) -> dict[str, Any]:
    engine = require_engine()
    return completion_body(
        _completion_id(entry),
        engine.served_name,
        entry.slot_id,
        entry.result,
        vocab=engine.vocab if entry.logprobs else None,
        replies=entry.replies,
        hydra_metrics=hydra_metrics(engine, entry),
    )


def hydra_metrics(engine: Engine, entry: DecodeEntry) -> dict[str, Any]:
    """The §6.3 ``hydra_metrics`` object of a decode request."""
    res: GenerationResult | None = entry.result
    m = entry.metrics
    n_common = res.n_common if res else 0
    stats, identity = engine.stats(), engine.identity
    return {
        "decode_request_id": entry.id,
        "id_slot": entry.slot_id,
        "n_past": m.n_past if m.n_past is not None else m.n_past_after_restore,
        "decode_ms": round(res.decode_ms, 3) if res else 0.0,
        "prompt_ms": round(res.prompt_ms, 3) if res else 0.0,
        "model_load_ms": round(stats.model_load_s * 1000.0, 3),
        "restore_slot_ms": round(m.restore_slot_ms, 3),
        "model_identity": identity.fields(),
        "match": m.match,
        # True when the KV carried in could not serve the prompt at all and it was
        # recomputed from scratch.
        "model_fallback": bool(m.kv_bytes and res is not None and n_common == 0 and not res.logits_reused),
        "n_common": n_common,
        "n_prompt_processed": res.n_prompt_processed if res else 0,
        "logits_reused": res.logits_reused if res else False,
        "kv_bytes": m.kv_bytes,
        "t3_reloaded": m.t3_reloaded,
        "t3_reload_ms": round(m.t3_reload_ms, 3),
        "decode_init_ms": round(m.decode_init_ms, 3),
        "validate_ms": round(m.validate_ms, 3),
        "queue_wait_ms": round(m.queue_wait_ms, 3),
        "ttft_ms": round(m.ttft_ms, 3),
        "tokens_per_s": round(res.tokens_per_s, 3) if res else 0.0,
        "stop_type": res.stop_type if res else "",
        "session_id": res.session_id if res else None,
    }


async def _sse_stream(manager: DecodeManager, entry: DecodeEntry) -> AsyncIterator[bytes]:
    """Every chunk so far, then live ones; a final chunk with usage and metrics, [DONE].

    A reader leaving does not affect the request (DELETE stops it). While this reader waits
    with every chunk sent, the generating task writes the next chunk's event to its socket
    itself (``sink``, through the connection's ``ChunkWriter``, as a chat stream's producer
    does): no wake-up, no trip through Quart and Hypercorn. It wakes the reader when it
    cannot (the socket full or gone, or a chunk only partly taken: the reader sends the
    rest first)."""
    cid = _completion_id(entry)
    model = manager.engine.served_name
    created = entry.created_unix
    # The chat stream's event per delta (a template, not the chunk serialised per token),
    # and every chunk that is ready in one write, as the chat stream does.
    delta_event = sse_text_events(completion_chunk(cid, created, model, delta={"content": HOLE}))
    # A reply parsed for tool calls or reasoning: each reader parses it (its events depend on
    # what came before), and the generating task never writes them itself.
    events = (
        None
        if entry.replies is None
        else ReplyEvents(entry.replies(), lambda delta: completion_chunk(cid, created, model, delta=delta))
    )
    if events is not None:
        delta_event = events.delta
    sub = entry.subscribe()
    turn = sub.turn
    sent = 0

    def sink() -> bool:
        # In the turn the reader handed over: every chunk it has not sent, while each goes
        # out whole (a partly written one leaves its rest in the turn, for the reader).
        nonlocal sent
        if not entry.running:
            return False
        while sent < len(entry.chunks):
            wrote = turn.write(entry.chunks[sent])
            if wrote is Wrote.NOTHING:
                return False
            sent += 1
            if wrote is Wrote.PART:
                return False
        return True

    try:
        yield sse_event(completion_chunk(cid, created, model, delta={"role": "assistant", "content": ""}))
        writer = chunk_writer()  # the response head is out
        if writer is not None and events is None:
            turn.attach(writer, delta_event)
            sub.sink = sink
        while True:
            await turn.send_rest()  # of a chunk the sink began: before anything else
            ready = len(entry.chunks)
            if sent < ready:
                out = b"".join(delta_event(text) for text in entry.chunks[sent:ready])
                sent = ready
                if out:  # a parsed reply may hold its text back
                    yield out
                continue  # more may have come while that was sent: look again before the end
            if not entry.running:
                break
            turn.hand_over()
            try:
                await sub.wakeups.receive()
            except trio.EndOfChannel:
                pass
            finally:
                turn.take_back()
        if entry.state == DecodeState.DONE:
            rest = b"" if events is None else events.rest(entry.result)
            parser = None if events is None else events.parser
            yield rest + sse_event(
                final_chunk(
                    cid,
                    created,
                    model,
                    entry.slot_id,
                    entry.result,
                    parser=parser,
                    hydra_metrics=hydra_metrics(manager.engine, entry),
                )
            )
            yield SSE_DONE
        else:
            code = "DECODE_FAILED" if entry.state == DecodeState.FAILED else entry.state.value.upper()
            receipt = turn_receipt(entry.result) if entry.result is not None else None
            yield sse_event(
                {
                    **error_body(
                        410 if entry.state != DecodeState.FAILED else 400,
                        entry.error or entry.state.value,
                        "decode_ended",
                    ),
                    "state": entry.state.value,
                    "error_code": code,
                    **({"receipt": receipt} if receipt else {}),
                }
            )
    finally:
        entry.unsubscribe(sub)
