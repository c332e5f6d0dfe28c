"""Kimi K2: ``<|tool_calls_section_begin|>``, then each call ``<|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{json}<|tool_call_end|>``; its id is the name as written. Pure."""

from __future__ import annotations

import re
from collections.abc import Callable

from ...structured import literal, regex, seq
from ..markup import elements, json_args
from .param_rules import json_rule
from .roster import register
from .toolformat import Block, Call, Detect, Props, ToolFormat, Trigger

KIMI_HEAD = re.compile(r"\s*(?:functions\.)?([^<:\s]+)(:\d+)?\s*")


def _read_kimi(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    """Kimi K2's calls; its id is the name as written, ``functions.NAME:IDX``."""
    calls: list[Call] = []
    for head, text in elements(body, "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>") or ():
        m = KIMI_HEAD.fullmatch(head)
        args = json_args(text) if m is not None else None
        if m is None or args is None:
            return None
        calls.append((m.group(1), args, f"functions.{m.group(1)}{m.group(2) or ':' + str(len(calls))}"))
    return calls or None


KIMI_K2 = register(ToolFormat(
    "kimi_k2",
    "arguments",
    before="<|tool_calls_section_begin|>",
    after="<|tool_calls_section_end|>",
    block=Block(
        openers=("<|tool_calls_section_begin|>",),
        closer="<|tool_calls_section_end|>",
        read=_read_kimi,
        call_end="<|tool_call_end|>",
    ),
    call_rule=json_rule(
        lambda t: seq(literal("<|tool_call_begin|>functions." + t.name + ":"), regex("[0-9]{1,5}"),
                      literal("<|tool_call_argument_begin|>")),
        "<|tool_call_end|>",
    ),
    triggers=(Trigger("<|tool_calls_section_begin|>", False, "<|tool_call_begin|>functions."),),
    detect=(Detect(30, ("<|tool_calls_section_begin|>",)),),
))
