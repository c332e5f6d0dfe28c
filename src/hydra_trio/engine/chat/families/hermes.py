"""Hermes 2 Pro and the many templates after it (Qwen 2.5 and 3, Granite 4, MiMo, ...): each
call's JSON object between ``<tool_call>`` tags. Pure."""

from __future__ import annotations

from .roster import register
from .toolformat import CALL_PREFIX, Detect, ToolFormat, Trigger

HERMES = register(ToolFormat(
    "hermes",
    "arguments",
    opener="<tool_call>",
    closer="</tool_call>",
    call_open="<tool_call>\n",
    call_close="\n</tool_call>",
    between="\n",
    triggers=(Trigger("<tool_call>", False, "\n" + CALL_PREFIX),),
    # after every family whose own markup writes <tool_call> too (Qwen3-Coder, GLM, Apriel 1.5, ...)
    detect=(Detect(270, ("<tool_call>",)),),
))
