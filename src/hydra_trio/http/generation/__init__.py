"""One generation over HTTP, the same for every API: a slot claimed and generated in, whole
or streamed (``generation``); every dialect's generation route, one way (``dialect``: a
dialect says only what differs); the one streaming event machine of the agents' dialects
(``event_machine``: each dialect's events a table); a reply read as its parts (``replies``)."""

from .dialect import (
    Answer,
    Codec,
    Dialect,
    Exchange,
    chat_tool,
    dialect_blueprint,
    dialect_names,
    error_in_shape,
    respond,
)
from .event_machine import BlockStream, Event, EventTable
from .generation import (
    Delta,
    GenerationStream,
    Prepare,
    Run,
    StreamEvents,
    error_event_body,
    generate_buffered,
    slot_for,
    sse_body,
    start_stream,
)
from .replies import Piece, ReplyParserFactory, cut, delta_pieces, receipt_fields, whole_pieces

__all__ = [
    "Answer",
    "BlockStream",
    "Codec",
    "Delta",
    "Dialect",
    "Event",
    "EventTable",
    "Exchange",
    "GenerationStream",
    "Piece",
    "Prepare",
    "ReplyParserFactory",
    "Run",
    "StreamEvents",
    "chat_tool",
    "cut",
    "delta_pieces",
    "dialect_blueprint",
    "dialect_names",
    "error_event_body",
    "error_in_shape",
    "generate_buffered",
    "receipt_fields",
    "respond",
    "slot_for",
    "sse_body",
    "start_stream",
    "whole_pieces",
]
