"""OpenAI-compatible routes and engine status: /health, /version, /slots,
/v1/chat/completions (/v1/models: model_routes.py, with the other models' routes)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from quart import Blueprint, Response

from ...engine import GenerationResult, ReplyParser, SlotInfo, TokenLogprobs, Vocabulary
from ..generation import (
    ReplyEvents,
    ReplyParserFactory,
    chat_message,
    delta_fields,
    finish_reason,
    generate_buffered,
    receipt_fields,
    sse_body,
    start_stream,
)
from ..models import routed_json
from ..plumbing import (
    HOLE,
    RETRY_AFTER,
    app_state,
    completion_chunk,
    generation_owner,
    json_response,
    now_s,
    request_session,
    require_engine,
    sse_event,
    sse_text_events,
    timings,
    usage,
)
from . import kv_transfer
from .logprobs import chat_logprobs

if TYPE_CHECKING:
    from ...serving import AppState

log = logging.getLogger(__name__)
bp = Blueprint("openai", __name__)


@bp.get("/health")
async def health() -> Response:
    status, body, headers = health_reply(app_state())
    return json_response(body, status, headers=headers)


def health_reply(state: AppState) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) of /health; also what a connection past
    --max-http-connections is answered (http/plumbing/connections.py)."""
    engine = state.engine
    if engine is None:
        return 503, {"status": "starting", "detail": state.startup_phase}, {}
    if state.draining:  # load balancers take the engine out; running requests finish
        return 503, {"status": "draining", "in_flight": state.in_flight()}, RETRY_AFTER
    stats, identity = engine.stats(), engine.identity
    return (
        200,
        {
            "status": "ok",
            "model": engine.served_name,
            "model_name": identity.model_name,
            "slots_idle": stats.slots_idle,
            "slots_processing": stats.slots_busy,
        },
        {},
    )


@bp.get("/version")
async def version() -> Response:
    from ... import __version__

    state = app_state()
    body: dict[str, Any] = {"engine": "hydra-trio", "version": __version__, "llama_cpp_python": state.llama_cpp_version}
    if state.engine is not None:  # hardware and template are known once the model is loaded
        body.update(state.engine.runtime_fields())
    if state.kv_events is not None:
        body["kv_events"] = state.kv_events.describe()
    return json_response(body)


@bp.get("/slots")
async def slots() -> Response:
    engine = require_engine()
    return json_response([slot_view(engine.slot_info(i)) for i in range(engine.stats().slots)])


def slot_view(info: SlotInfo) -> dict[str, Any]:
    """A slot in llama-server's /slots names (the description is ``Engine.slot_info``)."""
    return {
        "id": info.id,
        "id_slot": info.id,
        **info.fields(),
        "owner": info.owner,
        "n_ctx": info.n_ctx,  # what this slot can hold (llama-server's meaning)
    }


@bp.post("/v1/chat/completions")
async def chat_completions() -> Response:
    state = app_state()
    engine, body = await routed_json()  # the engine of the model it names
    session = request_session(body)  # its agent session (400 for a malformed hint)
    prepared = await engine.prepare("chat", body)  # 400 for what this engine would not honour
    params, tokens = prepared.params, prepared.tokens
    assert tokens is not None, "tokenized"
    # Tool calls and reasoning parsed from the reply (None: the text is the content).
    replies = prepared.replies
    cid = "chatcmpl-" + secrets.token_hex(12)
    model = params.model or engine.served_name  # a LoRA adapter the request's model named
    owner = generation_owner(cid)
    vocab = engine.vocab if params.logprobs is not None else None
    # P/D hand-off through a router's kv_transfer_params (http/completions/kv_transfer.py).
    plan = await kv_transfer.route(
        state, body, engine, tokens, params, partial(completion_body, cid, model, vocab=vocab, replies=replies)
    )
    if isinstance(plan, Response):
        return plan
    if not params.stream:
        slot_id, res = await generate_buffered(
            state, engine, tokens, params, owner=owner, path="chat", prepare=plan.restore, session=session
        )
        return json_response(completion_body(cid, model, slot_id, res, vocab=vocab, replies=replies, **plan.fields()))
    stream = await start_stream(
        state, engine, tokens, params, owner=owner, path="chat", prepare=plan.restore, session=session
    )

    created = now_s()
    head = sse_event(completion_chunk(cid, created, model, delta={"role": "assistant", "content": ""}))
    if replies is None:
        body = sse_body(
            stream,
            head=head,
            delta_event=sse_text_events(completion_chunk(cid, created, model, delta={"content": HOLE})),
            done_event=lambda res: sse_event(final_chunk(cid, created, model, stream.slot_id, res, **plan.fields())),
            logprobs_event=None if vocab is None else partial(_logprobs_chunk, vocab, cid, created, model),
        )
    else:
        events = ReplyEvents(replies(), lambda delta: completion_chunk(cid, created, model, delta=delta))
        body = sse_body(
            stream,
            head=head,
            delta_event=events.delta,
            done_event=lambda res: events.rest(res)
            + sse_event(final_chunk(cid, created, model, stream.slot_id, res, parser=events.parser, **plan.fields())),
            logprobs_event=None if vocab is None else partial(_parsed_logprobs_chunk, vocab, events, cid, created, model),
            direct=False,
        )
    return Response(body, status=200, content_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _logprobs_chunk(vocab: Vocabulary, cid: str, created: int, model: str, text: str, entries: Sequence[TokenLogprobs]) -> bytes:
    """A stream's chunk with its tokens' logprobs (requests that asked for them)."""
    chunk = completion_chunk(cid, created, model, delta={"content": text})
    chunk["choices"][0]["logprobs"] = chat_logprobs(vocab, entries)
    return sse_event(chunk)


def _parsed_logprobs_chunk(
    vocab: Vocabulary, events: ReplyEvents, cid: str, created: int, model: str, text: str, entries: Sequence[TokenLogprobs]
) -> bytes:
    """A parsed stream's chunk with its tokens' logprobs: every token's entry goes out when
    it comes, with whatever its text parsed into (an empty content while a call is held)."""
    chunk = completion_chunk(cid, created, model, delta=delta_fields(events.parser.feed(text)) or {"content": ""})
    chunk["choices"][0]["logprobs"] = chat_logprobs(vocab, entries)
    return sse_event(chunk)


def final_chunk(
    cid: str, created: int, model: str, slot_id: int | None, res: GenerationResult, *, parser: ReplyParser | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The last chunk of a stream: finish_reason, usage and timings (then [DONE])."""
    return completion_chunk(
        cid,
        created,
        model,
        delta={},
        finish_reason=finish_reason(res, parser),
        usage=usage(res.prompt_tokens, res.completion_tokens, res.n_common),
        timings=timings(res.n_prompt_processed, res.prompt_ms, res.completion_tokens, res.decode_ms, res.n_common),
        id_slot=slot_id,
        **receipt_fields(res),
        **extra,
    )


def completion_body(
    cid: str,
    model: str,
    slot_id: int | None,
    res: GenerationResult,
    *,
    vocab: Vocabulary | None = None,
    replies: ReplyParserFactory | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A whole chat completion; with ``vocab`` (logprobs asked) its choice carries them, with
    ``replies`` its text is parsed into content, reasoning and tool calls."""
    parser = replies() if replies is not None else None
    choice: dict[str, Any] = {"index": 0, "message": chat_message(res, parser), "finish_reason": finish_reason(res, parser)}
    if vocab is not None:
        choice["logprobs"] = chat_logprobs(vocab, res.logprobs)
    return {
        "id": cid,
        "object": "chat.completion",
        "created": now_s(),
        "model": model,
        "choices": [choice],
        "usage": usage(res.prompt_tokens, res.completion_tokens, res.n_common),
        "timings": timings(res.n_prompt_processed, res.prompt_ms, res.completion_tokens, res.decode_ms, res.n_common),
        "id_slot": slot_id,
        **receipt_fields(res),
        **extra,
    }
