"""Apertus: ``<|tools_prefix|>[{"NAME": {...arguments...}}, ...]<|tools_suffix|>``, the tool's
name the key of its arguments. Pure."""

from __future__ import annotations

from collections.abc import Callable

from ...structured import literal
from ..markup import json_items, object_args
from .param_rules import json_rule
from .roster import register
from .toolformat import Block, Call, Detect, Props, ToolFormat, Trigger


def _read_name_keyed(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    if (items := json_items(body)) is None:
        return None
    calls: list[Call] = []
    for item in items:
        if not isinstance(item, dict) or len(item) != 1:
            return None
        ((name, value),) = item.items()
        args = object_args(value)
        if not name or args is None:
            return None
        calls.append((name, args, None))
    return calls


APERTUS = register(ToolFormat(
    "apertus",
    "arguments",
    before="<|tools_prefix|>[",
    between=", ",
    after="]<|tools_suffix|>",
    block=Block(
        openers=("<|tools_prefix|>",), closer="<|tools_suffix|>", read=_read_name_keyed, call_end="}", list_close="]"
    ),
    call_rule=json_rule(lambda t: literal(f'{{"{t.name}": '), "}"),
    triggers=(Trigger("<|tools_prefix|>", False, '[{"'),),
    detect=(Detect(100, ("<|tools_prefix|>", "<|tools_suffix|>")),),
))
