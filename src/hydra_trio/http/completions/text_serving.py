"""A text completion answered (``answer_text``): a prompt continued as plain text, no chat
template, on the same generation path and batches as chat. ``echo``: the prompt leads the
text, and with logprobs each of its tokens' is scored given those before it; ``max_tokens``
0 with echo: the prompt alone (lm-eval's loglikelihood)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from quart import Response

from ...engine import GenerationResult, SlotLease, TokenLogprobs, Vocabulary
from ...wire.errors import bad_param
from ..generation import Answer, Exchange, GenerationStream, StreamEvents
from ..plumbing import HOLE, sse_event, sse_text_events
from . import kv_transfer
from .chat_protocol import now_s
from .kv_transfer import DecodeSide
from .logprobs import CompletionLogprobs
from .text_protocol import text_chunk, text_completion_body


async def answer_text(ex: Exchange) -> Answer | Response:
    body, engine, params, tokens, cid = ex.body, ex.engine, ex.params, ex.tokens, ex.id
    model = params.model or engine.served_name  # a LoRA adapter the request's model named
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
        echoed = (
            prompt if isinstance(prompt, str) else b"".join(map(pieces.token_bytes, tokens)).decode("utf-8", "replace")
        )
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
    plan = await kv_transfer.route(ex.state, body, engine, tokens, params, render)
    if isinstance(plan, Response):
        return plan
    prepare = plan.restore
    if echo and params.logprobs is not None:
        n_top = params.logprobs

        async def score(lease: SlotLease) -> None:
            scores[:] = await lease.score(tokens, n_top, salt=params.cache_salt, lora=params.lora)

        prepare = score
    return Answer(
        body=lambda slot_id, res: render(slot_id, res, **plan.fields()),
        events=lambda stream: _events(cid, model, echoed, vocab, bool(as_ids), plan, stream),
        prepare=prepare,
        prompt_only=echo and params.n_predict == 0,  # max_tokens 0: the prompt alone
    )


def _events(
    cid: str,
    model: str,
    echoed: str,
    vocab: Vocabulary | None,
    as_ids: bool,
    plan: DecodeSide,
    stream: GenerationStream,
) -> StreamEvents:
    created = now_s()
    return StreamEvents(
        head=sse_event(text_chunk(cid, created, model, echoed)) if echoed else b"",
        delta=sse_text_events(text_chunk(cid, created, model, HOLE)),
        done=lambda res: sse_event(
            text_completion_body(cid, created, model, stream.slot_id, res, text="", **plan.fields())
        ),
        logprobs=None
        if vocab is None
        else _logprobs_chunks(CompletionLogprobs(vocab, token_ids=as_ids), cid, created, model),
    )


def _logprobs_chunks(
    lp: CompletionLogprobs, cid: str, created: int, model: str
) -> Callable[[str, Sequence[TokenLogprobs]], bytes]:
    """A stream's chunks with their tokens' logprobs (text offsets counted on across them)."""
    return lambda text, entries: sse_event(text_chunk(cid, created, model, text, lp.take(entries)))


