"""OpenAI-compatible routes and engine status: /health, /version, /v1/models, /slots,
/v1/chat/completions."""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING, Any

import trio
from quart import Blueprint, Response

from ..engine.engine import GenerationResult
from ..engine.params import parse_generation
from ..tasks import start_owned
from ..wire.errors import ProtocolError
from . import kv_transfer
from .common import app_state, json_response, read_json_body, request_nursery, require_engine
from .sse import SSE_DONE, completion_chunk, error_body, now_s, sse_event, timings, usage

if TYPE_CHECKING:
    from ..state import AppState

log = logging.getLogger(__name__)
bp = Blueprint("openai", __name__)


@bp.get("/health")
async def health() -> Response:
    state = app_state()
    engine = state.engine
    if engine is None:
        return json_response({"status": "starting", "detail": state.startup_phase}, 503)
    busy = sum(1 for s in engine.slots.slots if s.busy)
    return json_response(
        {
            "status": "ok",
            "model": engine.identity.model_alias,
            "model_name": engine.identity.model_name,
            "slots_idle": len(engine.slots) - busy,
            "slots_processing": busy,
        }
    )


@bp.get("/version")
async def version() -> Response:
    from .. import __version__

    state = app_state()
    return json_response({"engine": "hydra-trio", "version": __version__, "llama_cpp_python": state.llama_cpp_version})


@bp.get("/v1/models")
async def models() -> Response:
    engine = require_engine()
    ident = engine.identity
    return json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": ident.model_alias,
                    "object": "model",
                    "created": int(app_state().started_at),
                    "owned_by": "hydra-trio",
                    "meta": {**ident.info_fields(), "n_ctx": engine.n_ctx, "n_vocab": engine.n_vocab},
                }
            ],
        }
    )


@bp.get("/slots")
async def slots() -> Response:
    engine = require_engine()
    return json_response([slot_view(engine, s.id) for s in engine.slots.slots])


def slot_view(engine: Any, slot_id: int) -> dict[str, Any]:
    slot = engine.slots.get(slot_id)
    return {
        "id": slot.id,
        "id_slot": slot.id,
        "is_processing": slot.busy,
        "is_transferring": slot.transferring,
        "owner": slot.owner,
        "n_past": engine.n_past(slot.id),
        "n_ctx": engine.n_ctx,
        "state_size": engine.state_size(slot.id),
    }


@bp.post("/v1/chat/completions")
async def chat_completions() -> Response:
    state = app_state()
    engine = require_engine()
    body = await read_json_body(state.settings.max_json_bytes)
    params = parse_generation(body, default_n_predict=state.settings.default_n_predict, n_ctx=engine.n_ctx)
    tokens = await engine.tokenize_request(body)
    cid = "chatcmpl-" + secrets.token_hex(12)
    model = engine.identity.model_alias
    # P/D hand-off through a router's kv_transfer_params (http/kv_transfer.py).
    exported = await kv_transfer.export_completion(state, body, tokens, params, partial(completion_body, cid, model))
    if exported is not None:
        return exported
    handoff = kv_transfer.begin_handoff(state, body)
    if not params.stream:
        try:
            with trio.fail_after(state.settings.slot_wait_s):
                slot = await engine.claim_for_prompt(tokens, f"http:{cid}")
        except trio.TooSlowError:
            return _all_slots_busy(state)
        try:
            logits = await kv_transfer.restore_handoff(state, handoff, engine, slot.id, tokens)
            res = await engine.generate(slot.id, tokens, params, _discard, logits=logits)
        finally:
            engine.release(slot)
        state.metrics.record_generation("chat", res)
        return json_response(completion_body(cid, model, slot.id, res, **kv_transfer.handoff_fields(handoff)))

    send, recv = trio.open_memory_channel[tuple[str, Any]](64)
    stall_s = state.settings.slot_wait_s

    async def produce(task_status: Any) -> None:
        try:
            with trio.fail_after(state.settings.slot_wait_s):
                slot = await engine.claim_for_prompt(tokens, f"http:{cid}")
        except trio.TooSlowError:
            raise _SlotsBusy from None
        task_status.started(slot.id)

        async def put(item: tuple[str, Any]) -> None:
            # A reader that stops reading without disconnecting must not hold the slot forever.
            with trio.fail_after(stall_s):
                await send.send(item)

        async def emit(delta: str) -> None:
            await put(("delta", delta))

        async with send:
            try:
                logits = await kv_transfer.restore_handoff(state, handoff, engine, slot.id, tokens)
                res = await engine.generate(slot.id, tokens, params, emit, logits=logits)
                state.metrics.record_generation("chat", res)
                await put(("done", res))
            except (ProtocolError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                log.info("streaming completion %s ended early: %r", cid, exc)
                with trio.move_on_after(0):
                    await send.send(("error", exc))
            finally:
                engine.release(slot)

    try:
        # The producer belongs to this request: it runs in the request's own nursery.
        task, slot_id = await start_owned(request_nursery(), f"chat:{cid}", produce)
    except _SlotsBusy:
        return _all_slots_busy(state)

    async def body_stream() -> AsyncIterator[bytes]:
        created = now_s()
        try:
            yield sse_event(completion_chunk(cid, created, model, delta={"role": "assistant", "content": ""}))
            async with recv:
                async for kind, value in recv:
                    if kind == "delta":
                        yield sse_event(completion_chunk(cid, created, model, delta={"content": value}))
                    elif kind == "done":
                        yield sse_event(
                            final_chunk(cid, created, model, slot_id, value, **kv_transfer.handoff_fields(handoff))
                        )
                    else:
                        yield sse_event(error_body(500, str(value), "server_error"))
            yield SSE_DONE
        finally:
            # Client gone or stream over: stop generation and wait until it has stopped.
            with trio.CancelScope(shield=True):
                await task.cancel_and_wait()

    return Response(body_stream(), status=200, content_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _SlotsBusy(Exception):
    pass


def _all_slots_busy(state: AppState) -> Response:
    return json_response(
        error_body(503, f"all slots are busy (waited {state.settings.slot_wait_s:g} s)", "unavailable_error"),
        503,
        headers={"Retry-After": "1"},
    )


async def _discard(_delta: str) -> None:
    return None


def final_chunk(cid: str, created: int, model: str, slot_id: int, res: GenerationResult, **extra: Any) -> dict[str, Any]:
    """The last chunk of a stream: finish_reason, usage and timings (then [DONE])."""
    return completion_chunk(
        cid,
        created,
        model,
        delta={},
        finish_reason=res.finish_reason,
        usage=usage(res.prompt_tokens, res.completion_tokens, res.n_common),
        timings=timings(res.n_prompt_processed, res.prompt_ms, res.completion_tokens, res.decode_ms, res.n_common),
        id_slot=slot_id,
        **extra,
    )


def completion_body(cid: str, model: str, slot_id: int, res: GenerationResult, **extra: Any) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": now_s(),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": res.text},
                "finish_reason": res.finish_reason,
            }
        ],
        "usage": usage(res.prompt_tokens, res.completion_tokens, res.n_common),
        "timings": timings(res.n_prompt_processed, res.prompt_ms, res.completion_tokens, res.decode_ms, res.n_common),
        "id_slot": slot_id,
        **extra,
    }
