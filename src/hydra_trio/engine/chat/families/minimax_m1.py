"""MiniMax M1: ``<tool_calls>\\n{"name": N, "arguments": {...}}\\n...\\n</tool_calls>``, one call's
JSON a line (arguments the template prints ``| tojson``, a string of JSON, are taken too). Pure."""

from __future__ import annotations

from collections.abc import Callable

from ....wire.jsontext import read_bounded_at
from ...structured import literal
from ..markup import NON_SPACE, object_args
from .param_rules import json_rule
from .roster import register
from .toolformat import CALL_PREFIX, Block, Call, Detect, Props, ToolFormat, Trigger


def _read_json_lines(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    calls: list[Call] = []
    pos = 0
    while (m := NON_SPACE.search(body, pos)) is not None:
        try:
            item, pos = read_bounded_at(body, m.start())
        except ValueError:
            return None
        if not isinstance(item, dict) or set(item) - {"name", "arguments"}:
            return None
        name, args = item.get("name"), object_args(item.get("arguments", {}))
        if not isinstance(name, str) or not name or args is None:
            return None
        calls.append((name, args, None))
    return calls or None


MINIMAX_M1 = register(ToolFormat(
    "minimax_m1",
    "arguments",
    before="<tool_calls>\n",
    between="\n",
    after="\n</tool_calls>",
    block=Block(openers=("<tool_calls>",), closer="</tool_calls>", read=_read_json_lines, call_end="}"),
    call_rule=json_rule(lambda t: literal(f'{{"name": "{t.name}", "arguments": '), "}"),
    triggers=(Trigger("<tool_calls>", False, "\n" + CALL_PREFIX),),
    detect=(Detect(250, ("</tool_calls><end_of_sentence>",)),),
))
