"""POST /v1/completions: OpenAI text completions (a prompt continued as plain text, no chat
template), on the same generation path and batches as chat."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from quart import Blueprint, Response

from ...engine import GenerationResult, SlotLease, TokenLogprobs
from ...wire.errors import bad_param
from ..generation import generate_buffered, receipt_fields, sse_body, start_stream
from ..models import routed_json
from ..plumbing import (
    HOLE,
    app_state,
    generation_owner,
    json_response,
    now_s,
    request_session,
    sse_event,
    sse_text_events,
    timings,
    usage,
)
from . import kv_transfer
from .logprobs import CompletionLogprobs

if TYPE_CHECKING:
    pass

bp = Blueprint("completions", __name__)


@bp.post("/v1/completions")
async def completions() -> Response:
    state = app_state()
    engine, body = await routed_json()  # the engine of the model it names
    session = request_session(body)  # its agent session (400 for a malformed hint)
    prepared = await engine.prepare("completions", body)  # 400 for what this engine would not honour
    params, tokens = prepared.params, prepared.tokens
    assert tokens is not None, "tokenized"
    cid = "cmpl-" + secrets.token_hex(12)
    model = params.model or engine.served_name  # a LoRA adapter the request's model named
    owner = generation_owner(cid)
    vocab = engine.vocab if params.logprobs is not None else None
    # echo: the prompt leads the text (as given, or its tokens' text); with logprobs, each of
    # its tokens' given those before it (lease.score: evaluated anew, generation goes on from it).
    echo = body.get("echo") is True
    if echo and body.get("kv_transfer_params") is not None:
        raise bad_param("echo is not supported with kv_transfer_params (a P/D hand-off)", "echo")
    echoed = ""
    if echo:
        prompt = body["prompt"][0] if isinstance(body["prompt"], list) and len(body["prompt"]) == 1 else body["prompt"]
        # Token ids: their text as generated text reads (control tokens show none), which the
        # logprobs' text_offset counts.
        pieces = engine.vocab
        echoed = prompt if isinstance(prompt, str) else b"".join(map(pieces.token_bytes, tokens)).decode("utf-8", "replace")
    scores: list[TokenLogprobs] = []
    as_ids = body.get("return_tokens_as_token_ids")
    if as_ids is not None and not isinstance(as_ids, bool):
        raise bad_param("return_tokens_as_token_ids must be a boolean", "return_tokens_as_token_ids")

    def render(slot_id: int | None, res: GenerationResult, **extra: Any) -> dict[str, Any]:
        lp = None
        if vocab is not None:
            lp = CompletionLogprobs(vocab, token_ids=bool(as_ids))
            lp = lp.merge(lp.echo(tokens, scores), lp.take(res.logprobs)) if echo else lp.take(res.logprobs)
        return text_completion_body(cid, now_s(), model, slot_id, res, logprobs=lp,
                                    text=echoed + res.text if echo else None, **extra)

    # P/D hand-off through a router's kv_transfer_params (http/completions/kv_transfer.py), as for chat.
    plan = await kv_transfer.route(state, body, engine, tokens, params, render)
    if isinstance(plan, Response):
        return plan
    prepare = plan.restore
    if echo and params.logprobs is not None:
        n_top = params.logprobs

        async def score(lease: SlotLease) -> None:
            scores[:] = await lease.score(tokens, n_top, salt=params.cache_salt, lora=params.lora)

        prepare = score
    only = echo and params.n_predict == 0  # max_tokens 0: the prompt alone (lm-eval's loglikelihood)
    if not params.stream:
        slot_id, res = await generate_buffered(
            state, engine, tokens, params, owner=owner, path="completions", prepare=prepare, prompt_only=only,
            session=session,
        )
        return json_response(render(slot_id, res, **plan.fields()))
    stream = await start_stream(
        state, engine, tokens, params, owner=owner, path="completions", prepare=prepare, prompt_only=only, session=session
    )

    created = now_s()
    body = sse_body(
        stream,
        head=sse_event(text_chunk(cid, created, model, echoed)) if echoed else b"",
        delta_event=sse_text_events(text_chunk(cid, created, model, HOLE)),
        done_event=lambda res: sse_event(
            text_completion_body(cid, created, model, stream.slot_id, res, text="", **plan.fields())
        ),
        logprobs_event=None if vocab is None else _logprobs_chunks(CompletionLogprobs(vocab, token_ids=bool(as_ids)), cid, created, model),
    )
    return Response(
        body,
        status=200,
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


def text_chunk(cid: str, created: int, model: str, text: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": None}],
    }


def _logprobs_chunks(
    lp: CompletionLogprobs, cid: str, created: int, model: str
) -> Callable[[str, Sequence[TokenLogprobs]], bytes]:
    """A stream's chunks with their tokens' logprobs (text offsets counted on across them)."""
    return lambda text, entries: sse_event(text_chunk(cid, created, model, text, lp.take(entries)))


def text_completion_body(
    cid: str,
    created: int,
    model: str,
    slot_id: int | None,
    res: GenerationResult,
    *,
    text: str | None = None,
    logprobs: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The whole completion, or (``text=""``) the last chunk of a stream: finish_reason,
    usage and timings (and ``extra`` fields, e.g. the P/D hand-off's)."""
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "text": res.text if text is None else text,
                "index": 0,
                "logprobs": logprobs,
                "finish_reason": res.finish_reason,
            }
        ],
        "usage": usage(res.prompt_tokens, res.completion_tokens, res.n_common),
        "timings": timings(
            res.n_prompt_processed,
            res.prompt_ms,
            res.completion_tokens,
            res.decode_ms,
            res.n_common,
        ),
        "id_slot": slot_id,
        **receipt_fields(res),
        **extra,
    }
