"""The generic form, for templates with no tool syntax of their own (as llama.cpp's generic
handler): the reply is one JSON object, ``{"tool_calls": [{"name": ..., "arguments": {...}}]}``.
No template is told to write it: it is what ``auto`` falls back to. Pure."""

from __future__ import annotations

from .roster import register
from .toolformat import CALL_PREFIX, ToolFormat, Trigger

GENERIC = register(ToolFormat(
    "generic",
    "arguments",
    at_start=True,
    list_key="tool_calls",
    before='{"tool_calls": [',
    between=", ",
    after="]}",
    triggers=(Trigger('{"tool_calls"', True, ": [" + CALL_PREFIX),),
))
