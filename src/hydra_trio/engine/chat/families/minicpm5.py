"""MiniCPM5: ``<function name="N"><param name="K">V</param>...</function>``, a call a line (a
value may be a ``<![CDATA[...]]>`` section, taken as it is). Pure."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ...structured import SchemaExpr, literal, seq
from ..markup import NON_SPACE, typed_value
from ..tools import Tool
from .param_rules import xml_param_rules
from .roster import register
from .toolformat import Block, Call, Detect, Props, ToolFormat, Trigger

_MINICPM_NAME = re.compile(r'([^"<>\n]+)">')
CDATA, CDATA_END = "<![CDATA[", "]]></param>"


def _read_minicpm(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    m = _MINICPM_NAME.match(body)
    if m is None:
        return None
    name, props = m.group(1).strip(), props_of(m.group(1).strip()) or {}
    args: dict[str, Any] = {}
    pos = m.end()
    while (w := NON_SPACE.search(body, pos)) is not None:  # <param name="K">V</param>, or V a CDATA section
        head = w.start() + len('<param name="')
        k = body.find('">', head) if body.startswith('<param name="', w.start()) else -1
        if k <= head or '"' in body[head:k]:
            return None
        v = k + 2
        cdata = body.startswith(CDATA, v) and (e := body.find(CDATA_END, v)) >= 0
        if not cdata:
            e = body.find("</param>", v)
        if e < 0:
            return None
        key = body[head:k]
        args[key] = body[v + len(CDATA):e] if cdata else typed_value(body[v:e], props.get(key))
        pos = e + (len(CDATA_END) if cdata else len("</param>"))
    return [(name, args, None)] if name else None


def _minicpm_rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
    params, rules = xml_param_rules(tool, i, schema, lambda k: (f'<param name="{k}">', "</param>"))
    return seq(literal(f'<function name="{tool.name}">'), params, literal("</function>")), rules


MINICPM5 = register(ToolFormat(
    "minicpm5",
    "arguments",
    between="\n",
    block=Block(openers=('<function name="',), closer="</function>", read=_read_minicpm),
    call_rule=_minicpm_rule,
    triggers=(Trigger("<function", False, ' name="'),),
    detect=(Detect(160, ("Tool usage guidelines:", '<function name="', '<param name="')),),  # as llama.cpp tells it
))
