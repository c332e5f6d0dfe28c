"""POST /v1/completions: OpenAI text completions (a prompt continued as plain text, no chat
template), on the same generation path and batches as chat."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from quart import Blueprint, Response

from ..engine.logprobs import TokenLogprobs
from ..engine.output import GenerationResult
from ..wire.errors import bad_param
from . import kv_transfer
from .common import app_state, generation_owner, json_response, read_request_json, require_engine
from .generation import SlotsBusy, all_slots_busy, generate_buffered, sse_body, start_stream
from .logprobs import CompletionLogprobs
from .openai_params import request_params
from .sse import HOLE, now_s, sse_event, sse_text_events, timings, usage

if TYPE_CHECKING:
    from ..engine.engine import Engine

bp = Blueprint("completions", __name__)


async def prompt_tokens(engine: Engine, prompt: Any) -> list[int]:
    """``prompt`` as a string, a token array, or a one-element array of either (OpenAI's
    batch form with one prompt) -> tokens. Strings get the model's BOS like any prompt."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await engine.inputs.tokenize_text(prompt)
    if isinstance(prompt, list) and len(prompt) >= engine.n_ctx_slot:
        engine.inputs.check_prompt_fits(len(prompt))  # before any per-token check (a 4 M-token array: ~1 s)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        n_vocab = engine.n_vocab
        bad = [t for t in prompt if not 0 <= t < n_vocab]
        if bad:
            raise bad_param(
                f"prompt holds token ids outside the vocabulary (0..{n_vocab - 1}): {bad[:5]}"
            )
        engine.inputs.check_prompt_fits(len(prompt))
        return list(prompt)
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str | list) for p in prompt)
    ):
        raise bad_param("one prompt per request: batched prompts are not supported")
    raise bad_param("prompt must be a non-empty string or a non-empty array of token ids")


@bp.post("/v1/completions")
async def completions() -> Response:
    state = app_state()
    engine = require_engine()
    body = await read_request_json()
    params = await request_params("completions", engine, body)  # 400 for what this engine would not honour
    tokens = await prompt_tokens(engine, body["prompt"])
    cid = "cmpl-" + secrets.token_hex(12)
    model = engine.identity.model_alias
    owner = generation_owner(cid)
    vocab = engine.vocab if params.logprobs is not None else None

    def render(slot_id: int, res: GenerationResult, **extra: Any) -> dict[str, Any]:
        lp = None if vocab is None else CompletionLogprobs(vocab).take(res.logprobs)
        return text_completion_body(cid, now_s(), model, slot_id, res, logprobs=lp, **extra)

    # P/D hand-off through a router's kv_transfer_params (http/kv_transfer.py), as for chat.
    plan = await kv_transfer.route(state, body, engine, tokens, params, render)
    if isinstance(plan, Response):
        return plan
    try:
        if not params.stream:
            slot_id, res = await generate_buffered(
                state, engine, tokens, params, owner=owner, path="completions", prepare=plan.restore
            )
            return json_response(render(slot_id, res, **plan.fields()))
        stream = await start_stream(
            state, engine, tokens, params, owner=owner, path="completions", prepare=plan.restore
        )
    except SlotsBusy:
        return all_slots_busy(state)

    created = now_s()
    body = sse_body(
        stream,
        head=b"",
        delta_event=sse_text_events(text_chunk(cid, created, model, HOLE)),
        done_event=lambda res: sse_event(
            text_completion_body(cid, created, model, stream.slot_id, res, text="", **plan.fields())
        ),
        logprobs_event=None if vocab is None else _logprobs_chunks(CompletionLogprobs(vocab), cid, created, model),
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
    slot_id: int,
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
        **extra,
    }
