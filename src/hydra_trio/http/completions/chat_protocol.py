"""OpenAI's chat completion shapes: the whole ``chat.completion`` and a stream's
``chat.completion.chunk``, a reply read into its message fields (``content``,
``reasoning_content``, ``tool_calls``; engine/chat/parser.py reads the text), whole and as a
stream's deltas, so chat, the P/D hand-off and ``GET /v1/decode/{id}`` shape it one way; the
``usage`` and llama-server's ``timings`` every completion carries. A request whose reply needs
no reading (no tools, no reasoning split) has no parser: its text is the content."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ...engine import GenerationResult, ReplyDelta, ReplyParser, ToolCall, Vocabulary
from ..generation import ReplyParserFactory, cut, receipt_fields
from ..plumbing import sse_event
from .logprobs import chat_logprobs


def completion_chunk(
    cid: str, created: int, model: str, *, delta: dict[str, Any], finish_reason: str | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        **extra,
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def timings(prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float, cached_n: int) -> dict[str, Any]:
    return {
        "cache_n": cached_n,
        "prompt_n": prompt_n,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_second": round(prompt_n / (prompt_ms / 1000.0), 3) if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_second": round((predicted_n - 1) / (predicted_ms / 1000.0), 3)
        if predicted_ms > 0 and predicted_n > 1
        else 0.0,
    }


def now_s() -> int:
    return int(time.time())


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def finish_reason(res: GenerationResult, parser: ReplyParser | None) -> str:
    """OpenAI's ``tool_calls`` when a reply that ended by itself made calls; else the
    generation's own reason (a call cut by max_tokens stays ``length``)."""
    if parser is not None and parser.calls and res.finish_reason == "stop":
        return "tool_calls"
    return res.finish_reason


def chat_message(res: GenerationResult, parser: ReplyParser | None) -> dict[str, Any]:
    """The whole reply as a chat message (``parser`` fresh: it parses ``res.text`` here)."""
    if parser is None:
        return {"role": "assistant", "content": res.text}
    parser.feed(res.text)
    parser.finish(cut=cut(res))
    message: dict[str, Any] = {
        "role": "assistant",
        "content": parser.content if parser.content or not parser.calls else None,
    }
    if parser.reasoning:
        message["reasoning_content"] = parser.reasoning
    if parser.calls:
        message["tool_calls"] = [tool_call_json(c) for c in parser.calls]
    return message


def delta_fields(delta: ReplyDelta) -> dict[str, Any] | None:
    """A stream chunk's ``delta`` for what one piece of text parsed into (None: nothing yet,
    the parser holds the text back)."""
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = [{"index": c.index, **tool_call_json(c)} for c in delta.tool_calls]
    return out or None


class ReplyEvents:
    """A parsed stream's SSE events: ``delta(text)`` for each text piece (b"" while the
    parser holds it back), ``rest()`` for what it held at the end; ``chunk(delta)`` makes
    the route's chunk around a delta."""

    def __init__(self, parser: ReplyParser, chunk: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.parser = parser
        self._chunk = chunk

    def delta(self, text: str) -> bytes:
        fields = delta_fields(self.parser.feed(text))
        return b"" if fields is None else sse_event(self._chunk(fields))

    def rest(self, res: GenerationResult) -> bytes:
        fields = delta_fields(self.parser.finish(cut=cut(res)))
        return b"" if fields is None else sse_event(self._chunk(fields))


def final_chunk(
    cid: str,
    created: int,
    model: str,
    slot_id: int | None,
    res: GenerationResult,
    *,
    parser: ReplyParser | None = None,
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
    choice: dict[str, Any] = {
        "index": 0,
        "message": chat_message(res, parser),
        "finish_reason": finish_reason(res, parser),
    }
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
