"""A reply as every dialect reads it: its receipt when its turn was cut, whether the length
cap ended it, and (for the agents' dialects) the pieces it is made of, whole or a stream's
delta at a time (engine/chat/parser.py reads the text). A request whose reply needs no
reading (no tools, no reasoning split) has no parser: its text is the content."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ...engine import GenerationResult, ReplyDelta, ReplyParser, ToolCall, turn_receipt

ReplyParserFactory = Callable[[], ReplyParser]  # a fresh parser for each reading of a reply


def receipt_fields(res: GenerationResult) -> dict[str, Any]:
    """A cut turn's ``receipt`` field (engine/receipts.py), for every reply shape; {} when
    the turn was not cut."""
    receipt = turn_receipt(res)
    return {} if receipt is None else {"receipt": receipt}


def cut(res: GenerationResult) -> bool:
    """Whether the length cap ended the reply (a call it left open is then never content)."""
    return res.finish_reason == "length"


# What a reply is made of, for the agents' dialects (http/messages/, http/responses/):
# reasoning text, content text, or one whole tool call, in the order they came.
Piece = tuple[str, str] | ToolCall  # ("reasoning" | "text", text), or a call


def _pieces(reasoning: str, content: str, calls: Iterable[ToolCall]) -> list[Piece]:
    """As the parser gives them: reasoning before content before calls."""
    out: list[Piece] = []
    if reasoning:
        out.append(("reasoning", reasoning))
    if content:
        out.append(("text", content))
    out.extend(calls)
    return out


def delta_pieces(delta: ReplyDelta) -> list[Piece]:
    """One parsed delta as pieces."""
    return _pieces(delta.reasoning, delta.content, delta.tool_calls)


def whole_pieces(res: GenerationResult, parser: ReplyParser | None) -> list[Piece]:
    """The whole reply as pieces (``parser`` fresh: it parses ``res.text`` here)."""
    if parser is None:
        return [("text", res.text)] if res.text else []
    parser.feed(res.text)
    parser.finish(cut=cut(res))
    return _pieces(parser.reasoning, parser.content, parser.calls)
