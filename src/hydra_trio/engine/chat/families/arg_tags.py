"""GLM-4.5/4.6/4.7 (and Ling 3, Laguna, Spark):
``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>``; Tencent
Hy3: ``:opensource`` in each tag, ``<tool_sep:opensource>`` after the name, the calls in its
``<tool_calls:opensource>`` section, one a line. Pure."""

from __future__ import annotations

from collections.abc import Callable

from ...structured import SchemaExpr, literal, seq
from ..markup import elements, xml_args
from ..tools import Tool
from .param_rules import xml_param_rules
from .roster import register
from .toolformat import Block, Call, CallRule, Detect, Props, Reader, ToolFormat, Trigger


def _arg_tags(s: str, sep: str) -> tuple[Reader, CallRule]:
    """One call's reader and rule: ``s`` its tags' suffix, ``sep`` what ends the name."""
    value_tag = f"<arg_value{s}>"

    def read(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
        k = body.find(f"<arg_key{s}>")
        name, rest = (body, "") if k < 0 else (body[:k], body[k:])
        name = name.strip().removesuffix(sep.strip()).strip()
        # each argument: <arg_key>K</arg_key>, whitespace, <arg_value>V</arg_value>
        args = elements(rest, f"<arg_key{s}>", f"</arg_key{s}>", f"</arg_value{s}>")
        if not name or "<" in name or "{" in name or args is None:
            return None
        values = [v.lstrip() for _, v in args]
        if not all(v.startswith(value_tag) for v in values):
            return None
        pairs = [(key.strip(), v[len(value_tag):]) for (key, _), v in zip(args, values, strict=True)]
        return [(name, xml_args(pairs, props_of(name)), None)]

    def rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
        params, rules = xml_param_rules(
            tool, i, schema, lambda k: (f"<arg_key{s}>{k}</arg_key{s}>\n<arg_value{s}>", f"</arg_value{s}>\n")
        )
        return seq(literal(f"<tool_call{s}>{tool.name}{sep}"), params, literal(f"</tool_call{s}>")), rules

    return read, rule


_read_glm, _glm_rule = _arg_tags("", "\n")
GLM = register(ToolFormat(
    "glm",
    "arguments",
    between="\n",
    block=Block(openers=("<tool_call>",), closer="</tool_call>", read=_read_glm),
    call_rule=_glm_rule,
    triggers=(Trigger("<tool_call>", False, ""),),
    detect=(Detect(180, ("<arg_key>", "<arg_value>")),),
))

_read_hy3, _hy3_rule = _arg_tags(":opensource", "<tool_sep:opensource>\n")
HY3_OPEN, HY3_CLOSE = "<tool_calls:opensource>", "</tool_calls:opensource>"
HY3 = register(ToolFormat(
    "hy3",
    "arguments",
    before=HY3_OPEN + "\n",
    between="\n",
    after="\n" + HY3_CLOSE,
    block=Block(openers=("<tool_call:opensource>",), closer="</tool_call:opensource>", read=_read_hy3),
    call_rule=_hy3_rule,
    dropped=(HY3_OPEN, HY3_CLOSE),  # the section around the calls
    triggers=(Trigger(HY3_OPEN, False, "\n<tool_call:opensource>"),),
    detect=(Detect(170, ("<tool_sep{}>", "<arg_key{}>", ":opensource")),),  # Hy3 formats its tags with the suffix
))
