"""Kimi K3's XTML tags: ``<|open|>tools<|sep|><|open|>call tool="N" index="1"<|sep|>
<|open|>argument key="K" type="T"<|sep|>V<|close|>argument<|sep|>...<|close|>call<|sep|>...
<|close|>tools<|sep|>``; its content's response and message tags are dropped. Pure."""

from __future__ import annotations

import re
from collections.abc import Callable

from ...structured import SchemaExpr, literal, regex, seq
from ..markup import elements, json_args, typed_value
from ..tools import Tool
from .param_rules import xml_param_rules
from .roster import register
from .toolformat import Block, Call, Detect, Props, ToolFormat, Trigger

K3_CALL = re.compile(r'([^"]+)"(?: index="[^"]*")?')  # a call's head: tool="NAME" index="1"
K3_ARG = re.compile(r'([^"]+)"(?: type="([^"]*)")?')  # an argument's head: key="K" type="T"
K3_JSON = re.compile(r'\s*<\|open\|>json(?: type="object")?<\|sep\|>(.*?)<\|close\|>json<\|sep\|>\s*', re.S)
_K3_TYPES = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "null": "null",
             "object": "object", "array": "array"}


def _unescape_attr(text: str) -> str:
    return text.replace("&quot;", '"').replace("&amp;", "&")


def _read_kimi_k3(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    calls: list[Call] = []
    for head, inner in elements(body, '<|open|>call tool="', "<|sep|>", "<|close|>call<|sep|>") or ():
        m = K3_CALL.fullmatch(head)
        whole = K3_JSON.fullmatch(inner)
        if m is None:
            return None
        if whole is not None:
            args = json_args(whole.group(1))
            if args is None:
                return None
        else:
            found = elements(inner, '<|open|>argument key="', "<|sep|>", "<|close|>argument<|sep|>")
            heads = [K3_ARG.fullmatch(h) for h, _ in found or ()]
            if found is None or None in heads:
                return None
            args = {}
            for am, (_, text) in zip(heads, found, strict=True):
                assert am is not None
                args[_unescape_attr(am.group(1))] = text if am.group(2) == "string" else typed_value(text, None)
        calls.append((_unescape_attr(m.group(1)), args, None))
    return calls or None


def _k3_rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
    props = tool.parameters.get("properties") or {} if isinstance(tool.parameters, dict) else {}

    def write(k: str) -> tuple[str, str]:
        s = props.get(k)
        kind = (
            _K3_TYPES.get(s.get("type"), "object")
            if isinstance(s, dict) and isinstance(s.get("type"), str)
            else "object"
        )
        return f'<|open|>argument key="{k}" type="{kind}"<|sep|>', "<|close|>argument<|sep|>"

    params, rules = xml_param_rules(tool, i, schema, write)
    call_open = '<|open|>call tool="' + tool.name + '" index="'
    head = seq(literal(call_open), regex("[1-9][0-9]?"), literal('"<|sep|>'))
    return seq(head, params, literal("<|close|>call<|sep|>")), rules


KIMI_K3 = register(ToolFormat(
    "kimi_k3",
    "arguments",
    before="<|open|>tools<|sep|>",
    after="<|close|>tools<|sep|>",
    block=Block(
        openers=("<|open|>tools<|sep|>",), closer="<|close|>tools<|sep|>", read=_read_kimi_k3,
        call_end="<|close|>call<|sep|>"
    ),
    call_rule=_k3_rule,
    dropped=("<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|close|>message<|sep|>"),
    triggers=(Trigger("<|open|>tools<|sep|>", False, '<|open|>call tool="'),),
    # its tags built from these, as llama.cpp tells it
    detect=(Detect(40, ("<|open|>", "<|close|>", "<|end_of_msg|>")),),
))
