"""Gemma 4: ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>`` (bare keys, strings
between ``<|"|>``). Pure."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from ...structured import SchemaExpr, literal, seq
from ..markup import json_args
from ..tools import Tool
from .param_rules import xml_param_rules
from .roster import register
from .toolformat import Block, Call, Detect, Props, ToolFormat, Trigger

GEMMA_QUOTE = '<|"|>'
_GEMMA_QUOTES = re.compile(r'<\|"\|>|"')
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_GEMMA_KEY = re.compile(r"([{,]\s*)([A-Za-z_][\w.-]*)\s*:")


def gemma_args(text: str) -> dict[str, Any] | None:
    """Gemma 4's argument object (bare keys, strings between ``<|"|>``) as a dict."""
    if "\x00" in text:
        return None  # (it marks the strings set aside below)
    strings: list[str] = []
    parts: list[str] = []
    pos = 0
    while (m := _GEMMA_QUOTES.search(text, pos)) is not None:  # the strings set aside, in one pass
        if m.group() == GEMMA_QUOTE:
            end = text.find(GEMMA_QUOTE, m.end())
            literal = json.dumps(text[m.end():end]) if end >= 0 else None
            after = end + len(GEMMA_QUOTE)
        else:
            s = _JSON_STRING.match(text, m.start())
            literal, after = (s.group(), s.end()) if s is not None else (None, 0)
        if literal is None:
            return None  # an unclosed string
        strings.append(literal)
        parts.append(f"{text[pos:m.start()]}\x00{len(strings) - 1}\x00")
        pos = after
    held = "".join(parts) + text[pos:]
    held = _GEMMA_KEY.sub(lambda m: f'{m.group(1)}"{m.group(2)}":', held)
    held = re.sub(r",\s*([}\]])", r"\1", held)  # the grammar writes a comma after each argument
    return json_args(re.sub(r"\x00(\d+)\x00", lambda m: strings[int(m.group(1))], held))


def _read_gemma(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    body = body.strip()
    if not body.startswith("call:"):
        return None
    name, brace, rest = body[len("call:"):].partition("{")
    args = gemma_args(brace + rest) if brace else None
    return [(name.strip(), args, None)] if name.strip() and args is not None else None


def _gemma_rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
    props = tool.parameters.get("properties") or {} if isinstance(tool.parameters, dict) else {}

    def write(k: str) -> tuple[str, str]:
        s = props.get(k)
        quoted = isinstance(s, dict) and s.get("type") == "string"
        return (f"{k}:{GEMMA_QUOTE}" if quoted else f"{k}:"), (f"{GEMMA_QUOTE}," if quoted else ",")

    params, rules = xml_param_rules(tool, i, schema, write)
    return seq(literal(f"<|tool_call>call:{tool.name}{{"), params, literal("}<tool_call|>")), rules


GEMMA4 = register(ToolFormat(
    "gemma4",
    "arguments",
    block=Block(openers=("<|tool_call>",), closer="<tool_call|>", read=_read_gemma),
    call_rule=_gemma_rule,
    triggers=(Trigger("<|tool_call>", False, "call:"),),
    detect=(Detect(140, ("<|tool_call>", "<tool_call|>")),),
))
