"""One generation over HTTP, the same for every API: a slot claimed and generated in, whole
or streamed (``generation``), and a reply read as its parts (``replies``)."""

from .generation import (
    Delta,
    GenerationStream,
    Prepare,
    error_event_body,
    generate_buffered,
    slot_for,
    sse_body,
    start_stream,
)
from .replies import (
    Piece,
    ReplyEvents,
    ReplyParserFactory,
    chat_message,
    cut,
    delta_fields,
    delta_pieces,
    finish_reason,
    receipt_fields,
    whole_pieces,
)

__all__ = [
    "Delta", "GenerationStream", "Piece", "Prepare", "ReplyEvents", "ReplyParserFactory", "chat_message", "cut",
    "delta_fields", "delta_pieces", "error_event_body", "finish_reason", "generate_buffered", "receipt_fields",
    "slot_for", "sse_body", "start_stream", "whole_pieces",
]
