"""Mistral's named calls, each ``[TOOL_CALLS]NAME[ARGS]{json}`` and no closer (several in a
row, the reply's end the last one's): Ministral 3, Magistral and Devstral Small 2507
(``mistral_args``); Mistral Small 3.2 writes the call's id between, ``[TOOL_CALLS]NAME[CALL_ID]
ID[ARGS]{json}`` (``mistral_call_id``), and the call keeps it. Older templates (Mistral Nemo)
write one JSON list, ``[TOOL_CALLS][{...}]`` (json_lists.py's ``mistral``). Told apart as
llama.cpp does (common/chat.cpp ``common_chat_try_specialized_template``: ``[ARGS]`` with
``[CALL_ID]`` or without), before the plain ``[TOOL_CALLS]`` rule. The scanner reads a call's
head up to ``[ARGS]`` and its JSON (scanner.py ``_headed``). Pure."""

from __future__ import annotations

from ...structured import literal, regex, seq
from .param_rules import json_rule
from .roster import register
from .toolformat import Detect, ToolFormat, Trigger

OPENER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
# The id Mistral Small 3.2's template demands of a call ("alphanumeric strings with length 9")
CALL_ID_RE = "[a-zA-Z0-9]{9}"


def _named(name: str, *, with_id: bool, priority: int, marks: tuple[str, ...]) -> ToolFormat:
    head = (
        (lambda t: seq(literal(t.name + CALL_ID), regex(CALL_ID_RE), literal(ARGS)))
        if with_id
        else (lambda t: literal(t.name + ARGS))
    )
    return ToolFormat(
        name,
        "arguments",
        opener=OPENER,
        args_mark=ARGS,
        id_mark=CALL_ID if with_id else "",
        call_open=OPENER,  # each call its own marker, nothing between or around them
        call_rule=json_rule(head, ""),
        # the grammar writes a declared tool's name next (llama.cpp's word trigger)
        triggers=(Trigger(OPENER, False, ""),),
        detect=(Detect(priority, marks),),
    )


MISTRAL_CALL_ID = register(_named("mistral_call_id", with_id=True, priority=274, marks=(OPENER, CALL_ID, ARGS)))
MISTRAL_ARGS = register(_named("mistral_args", with_id=False, priority=276, marks=(OPENER, ARGS)))
