"""GigaChat3 (its "function call" role's message after the reply's; one call, the template
shows no second) and GigaChat3.1 (``<|function_call|>`` and the call's JSON). Pure."""

from __future__ import annotations

from .roster import register
from .toolformat import CALL_PREFIX, Detect, ToolFormat, Trigger

GIGA3_CALL = "<|message_sep|>\n\nfunction call<|role_sep|>"
GIGACHAT3 = register(ToolFormat(
    "gigachat3",
    "arguments",
    opener=GIGA3_CALL,
    before=GIGA3_CALL + "\n",
    between=GIGA3_CALL + "\n",
    triggers=(Trigger(GIGA3_CALL, False, "\n" + CALL_PREFIX),),
    detect=(Detect(240, ("<|role_sep|>", "<|message_sep|>", "function call")),),  # after 3.1's, as llama.cpp
))
# GigaChat3.1: <|function_call|>{"name": ..., "arguments": {...}}
GIGACHAT3_1 = register(ToolFormat(
    "gigachat3_1",
    "arguments",
    opener="<|function_call|>",
    before="<|function_call|>",
    between="<|function_call|>",
    triggers=(Trigger("<|function_call|>", False, CALL_PREFIX),),
    detect=(Detect(230, ("<|function_call|>", "<|role_sep|>")),),
))
