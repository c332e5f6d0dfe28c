"""``<invoke name="N"><parameter name="K">V</parameter></invoke>``: MiniMax M2 (in its
``<minimax:tool_call>`` section) and DeepSeek V3.2 and V4 (DSML: each tag after ``｜DSML｜``, a
parameter's ``string="true|false"`` saying whether its value is text or JSON). Pure."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ...structured import SchemaExpr, literal, seq
from ..markup import elements, trim_nl, typed_value
from ..tools import Tool
from .param_rules import xml_param_rules
from .roster import register
from .toolformat import Block, Call, CallRule, Detect, Props, Reader, ToolFormat, Trigger

_PARAM_HEAD = re.compile(r'([^"]+)"(?: string="(true|false)")?')


def _invoke_reader(p: str) -> Reader:
    def read(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
        calls: list[Call] = []
        for name, inner in elements(body, f'<{p}invoke name="', '">', f"</{p}invoke>") or ():
            params = elements(inner, f'<{p}parameter name="', ">", f"</{p}parameter>")
            heads = [_PARAM_HEAD.fullmatch(head) for head, _ in params or ()]
            if not name or '"' in name or params is None or None in heads:
                return None
            props = props_of(name) or {}
            args: dict[str, Any] = {}
            for m, (_, value) in zip(heads, params, strict=True):
                assert m is not None
                key, is_string, text = m.group(1), m.group(2), trim_nl(value)
                args[key] = text if is_string == "true" else typed_value(text, None if is_string else props.get(key))
            calls.append((name, args, None))
        return calls or None

    return read


def _invoke_rule(p: str, dsml: bool) -> CallRule:
    def rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
        props = tool.parameters.get("properties") or {} if isinstance(tool.parameters, dict) else {}

        def write(k: str) -> tuple[str, str]:
            s = props.get(k)
            flag = (
                (' string="true"' if isinstance(s, dict) and s.get("type") == "string" else ' string="false"')
                if dsml
                else ""
            )
            return f'<{p}parameter name="{k}"{flag}>', f"</{p}parameter>\n"

        params, rules = xml_param_rules(tool, i, schema, write)
        head = literal(f'\n<{p}invoke name="{tool.name}">\n')
        return seq(head, params, literal(f"</{p}invoke>\n")), rules

    return rule


MINIMAX = register(ToolFormat(
    "minimax",
    "arguments",
    before="<minimax:tool_call>",
    after="</minimax:tool_call>",
    block=Block(openers=("<minimax:tool_call>",), closer="</minimax:tool_call>", read=_invoke_reader(""),
                call_end="</invoke>"),
    call_rule=_invoke_rule("", False),
    triggers=(Trigger("<minimax:tool_call>", False, '\n<invoke name="'),),
    detect=(Detect(70, ("<minimax:tool_call>",)),),
))
DEEPSEEK_DSML = register(ToolFormat(
    "deepseek_dsml",
    "arguments",
    before="<｜DSML｜function_calls>",
    after="</｜DSML｜function_calls>",
    block=Block(
        openers=("<｜DSML｜function_calls>", "<｜DSML｜tool_calls>"),  # V3.2's, V4's
        closer="</｜DSML｜function_calls>",
        closers=("</｜DSML｜function_calls>", "</｜DSML｜tool_calls>"),
        read=_invoke_reader("｜DSML｜"),
        call_end="</｜DSML｜invoke>",
    ),
    call_rule=_invoke_rule("｜DSML｜", True),
    triggers=(Trigger("<｜DSML｜function_calls>", False, '\n<｜DSML｜invoke name="'),),
    detect=(Detect(50, ("｜DSML｜",)),),
))
