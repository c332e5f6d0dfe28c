"""Qwen3-Coder (and Qwen3.5, Nemotron 3, StepFun 3.5) and ByteDance Seed-OSS:
``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>``
(Seed-OSS's tags ``<seed:tool_call>``), each value typed by the tool's schema. Pure."""

from __future__ import annotations

from collections.abc import Callable

from ...structured import SchemaExpr, literal, seq
from ..markup import elements, xml_args
from ..tools import Tool
from .param_rules import xml_param_rules
from .roster import register
from .toolformat import Block, Call, CallRule, Detect, Props, ToolFormat, Trigger


def _read_function(body: str, opener: str, props_of: Callable[[str], Props | None], fn: str) -> list[Call] | None:
    """One ``<function=NAME>...`` call; the opener is the tool-call tag (then the function
    tag follows it) or, as some models write it, the function tag itself."""
    if opener != fn:
        body = body.lstrip()
        if not body.startswith(fn):
            return None
        body = body[len(fn):]
    name, sep, rest = body.partition(">")
    name = name.strip()
    params = elements(rest, "<parameter=", ">", "</parameter>")
    if not sep or not name or params is None or any(not k or "\n" in k for k, _ in params):
        return None  # text outside the parameters: not a call
    return [(name, xml_args([(k.strip(), v) for k, v in params], props_of(name)), None)]


def _qwen_rule(call_open: str, call_close: str) -> CallRule:
    def rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
        params, rules = xml_param_rules(tool, i, schema, lambda k: (f"<parameter={k}>\n", "\n</parameter>\n"), True)
        head = literal(f"{call_open}\n<function={tool.name}>\n")
        return seq(head, params, literal(f"</function>\n{call_close}")), rules

    return rule


def _function_tags(name: str, call_open: str, call_close: str, detect: Detect) -> ToolFormat:
    return ToolFormat(
        name,
        "arguments",
        between="\n",
        block=Block(
            openers=(call_open, "<function="),
            closer="</function>",
            tail=call_close,
            read=lambda body, opener, props: _read_function(body, opener, props, "<function="),
        ),
        call_rule=_qwen_rule(call_open, call_close),
        triggers=(Trigger(call_open, False, "\n<function="),),
        detect=(detect,),
    )


QWEN3_CODER = register(
    _function_tags("qwen3_coder", "<tool_call>", "</tool_call>", Detect(190, ("<function=", "<parameter=")))
)
SEED_OSS = register(
    _function_tags("seed_oss", "<seed:tool_call>", "</seed:tool_call>", Detect(150, ("<seed:tool_call>",)))
)
