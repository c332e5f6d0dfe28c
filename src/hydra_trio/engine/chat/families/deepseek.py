"""DeepSeek V3.1 (``NAME<｜tool▁sep｜>{json}``) and R1 (``function<｜tool▁sep｜>NAME\\n```json\\n
{json}```), each call between its markers inside the calls' section. Pure."""

from __future__ import annotations

import re
from collections.abc import Callable

from ...structured import literal
from ..markup import elements, json_args
from .param_rules import json_rule
from .roster import register
from .toolformat import Block, Call, Detect, Props, ToolFormat, Trigger

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_R1 = re.compile(r"([^\n<]+)\n```(?:json)?\n?(.*?)```\s*", re.S)


def _read_deepseek(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    """DeepSeek V3.1's ``NAME<｜tool▁sep｜>{json}`` and R1's ``function<｜tool▁sep｜>NAME\\n```json\\n{json}```"""
    calls: list[Call] = []
    for name, text in elements(body, "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>") or ():
        r1 = DS_R1.fullmatch(text) if name == "function" else None
        if r1 is not None:
            name, text = r1.group(1), r1.group(2)
        args = json_args(text)
        if args is None or "<" in name or not name.strip():
            return None
        calls.append((name.strip(), args, None))
    return calls or None


DEEPSEEK = register(ToolFormat(
    "deepseek",
    "arguments",
    before=DS_BEGIN,
    after=DS_END,
    block=Block(openers=(DS_BEGIN,), closer=DS_END, read=_read_deepseek, call_end="<｜tool▁call▁end｜>"),
    call_rule=json_rule(lambda t: literal(f"<｜tool▁call▁begin｜>{t.name}<｜tool▁sep｜>"), "<｜tool▁call▁end｜>"),
    triggers=(Trigger(DS_BEGIN, False, "<｜tool▁call▁begin｜>"),),
    detect=(Detect(60, (DS_BEGIN,)),),
))
