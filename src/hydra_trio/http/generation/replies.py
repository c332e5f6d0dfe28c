"""A chat reply parsed into OpenAI's message fields: ``content``, ``reasoning_content`` and
``tool_calls`` (engine/chat/parser.py parses the text), for the whole reply and for a stream's
deltas, so chat, the P/D hand-off and ``GET /v1/decode/{id}`` shape it one way.

A request whose reply needs no parsing (no tools, no reasoning split) has no parser and its
text is the content, as before."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...engine import GenerationResult, ReplyDelta, ReplyParser, ToolCall, turn_receipt
from ..plumbing import sse_event

ReplyParserFactory = Callable[[], ReplyParser]  # a fresh parser for each reading of a reply


def receipt_fields(res: GenerationResult) -> dict[str, Any]:
    """A cut turn's ``receipt`` field (engine/receipts.py), for every reply shape; {} when
    the turn was not cut."""
    receipt = turn_receipt(res)
    return {} if receipt is None else {"receipt": receipt}


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def cut(res: GenerationResult) -> bool:
    """Whether the length cap ended the reply (a call it left open is then never content)."""
    return res.finish_reason == "length"


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
    message: dict[str, Any] = {"role": "assistant", "content": parser.content if parser.content or not parser.calls else None}
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


# What a reply is made of, for the agents' dialects (http/messages/messages_protocol.py, http/responses/responses_protocol.py):
# reasoning text, content text, or one whole tool call, in the order they came.
Piece = tuple[str, str] | ToolCall  # ("reasoning" | "text", text), or a call


def delta_pieces(delta: ReplyDelta) -> list[Piece]:
    """One parsed delta as pieces (the parser gives reasoning before content before calls)."""
    out: list[Piece] = []
    if delta.reasoning:
        out.append(("reasoning", delta.reasoning))
    if delta.content:
        out.append(("text", delta.content))
    out.extend(delta.tool_calls)
    return out


def whole_pieces(res: GenerationResult, parser: ReplyParser | None) -> list[Piece]:
    """The whole reply as pieces (``parser`` fresh: it parses ``res.text`` here)."""
    if parser is None:
        return [("text", res.text)] if res.text else []
    parser.feed(res.text)
    parser.finish(cut=cut(res))
    out: list[Piece] = []
    if parser.reasoning:
        out.append(("reasoning", parser.reasoning))
    if parser.content:
        out.append(("text", parser.content))
    out.extend(parser.calls)
    return out
