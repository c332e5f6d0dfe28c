"""A chat completion answered (``answer_chat``): a P/D hand-off's prefill side answered at
once, else its whole ``chat.completion`` or its stream of chunks (each with its tokens'
logprobs when asked; a parsed reply's as it reads), in http/completions/chat_protocol.py's
shapes."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from quart import Response

from ...engine import TokenLogprobs, Vocabulary
from ..generation import Answer, Exchange, GenerationStream, ReplyParserFactory, StreamEvents
from ..plumbing import HOLE, sse_event, sse_text_events
from . import kv_transfer
from .chat_protocol import (
    ReplyEvents,
    completion_body,
    completion_chunk,
    delta_fields,
    final_chunk,
    now_s,
)
from .kv_transfer import DecodeSide
from .logprobs import chat_logprobs


async def answer_chat(ex: Exchange) -> Answer | Response:
    params, engine, replies = ex.params, ex.engine, ex.prepared.replies
    model = params.model or engine.served_name  # a LoRA adapter the request's model named
    vocab = engine.vocab if params.logprobs is not None else None
    # P/D hand-off through a router's kv_transfer_params (http/completions/kv_transfer.py).
    plan = await kv_transfer.route(
        ex.state,
        ex.body,
        engine,
        ex.tokens,
        params,
        partial(completion_body, ex.id, model, vocab=vocab, replies=replies),
    )
    if isinstance(plan, Response):
        return plan
    return Answer(
        body=lambda slot_id, res: completion_body(
            ex.id, model, slot_id, res, vocab=vocab, replies=replies, **plan.fields()
        ),
        events=partial(_events, ex.id, model, vocab, replies, plan),
        prepare=plan.restore,
    )


def _events(
    cid: str, model: str, vocab: Vocabulary | None, replies: ReplyParserFactory | None, plan: DecodeSide,
    stream: GenerationStream,
) -> StreamEvents:
    created = now_s()
    head = sse_event(completion_chunk(cid, created, model, delta={"role": "assistant", "content": ""}))
    if replies is None:
        return StreamEvents(
            head=head,
            delta=sse_text_events(completion_chunk(cid, created, model, delta={"content": HOLE})),
            done=lambda res: sse_event(final_chunk(cid, created, model, stream.slot_id, res, **plan.fields())),
            logprobs=None if vocab is None else partial(_logprobs_chunk, vocab, cid, created, model),
        )
    events = ReplyEvents(replies(), lambda delta: completion_chunk(cid, created, model, delta=delta))
    return StreamEvents(
        head=head,
        delta=events.delta,
        done=lambda res: events.rest(res)
        + sse_event(final_chunk(cid, created, model, stream.slot_id, res, parser=events.parser, **plan.fields())),
        logprobs=None if vocab is None else partial(_parsed_logprobs_chunk, vocab, events, cid, created, model),
        direct=False,
    )


def _logprobs_chunk(
    vocab: Vocabulary, cid: str, created: int, model: str, text: str, entries: Sequence[TokenLogprobs]
) -> bytes:
    """A stream's chunk with its tokens' logprobs (requests that asked for them)."""
    chunk = completion_chunk(cid, created, model, delta={"content": text})
    chunk["choices"][0]["logprobs"] = chat_logprobs(vocab, entries)
    return sse_event(chunk)


def _parsed_logprobs_chunk(
    vocab: Vocabulary,
    events: ReplyEvents,
    cid: str,
    created: int,
    model: str,
    text: str,
    entries: Sequence[TokenLogprobs],
) -> bytes:
    """A parsed stream's chunk with its tokens' logprobs: every token's entry goes out when
    it comes, with whatever its text parsed into (an empty content while a call is held)."""
    chunk = completion_chunk(cid, created, model, delta=delta_fields(events.parser.feed(text)) or {"content": ""})
    chunk["choices"][0]["logprobs"] = chat_logprobs(vocab, entries)
    return sse_event(chunk)


