"""Upstage Solar Open: ``<|tool_calls|>``, then each call
``<|tool_call:begin|>ID<|tool_call:name|>N<|tool_call:args|>{...}<|tool_call:end|>`` (its id the
model's). Its content's ``<|content|>...<|end|>`` wrapper (llama.cpp's) and the assistant
header a reply repeats after its reasoning are dropped. Pure."""

from __future__ import annotations

from collections.abc import Callable

from ...structured import SchemaExpr, literal, regex, seq
from ..markup import json_args
from ..tools import Tool
from .roster import register
from .toolformat import Block, Call, Detect, Props, ToolFormat, Trigger

SOLAR_BEGIN, SOLAR_END = "<|tool_call:begin|>", "<|tool_call:end|>"


def _read_solar(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    """One call; its id is the model's (the grammar writes a call index, as Cohere's)."""
    given, sep, rest = body.partition("<|tool_call:name|>")
    name, sep2, args_text = rest.partition("<|tool_call:args|>")
    args = json_args(args_text) if sep and sep2 else None
    if args is None or not name.strip() or "<" in given:
        return None
    return [(name.strip(), args, given.strip() or None)]


def _solar_rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
    args = f"t{i}-args: {schema(tool.parameters, f'tools[{i}].function.parameters')}"
    head = seq(
        literal(SOLAR_BEGIN), regex("[0-9]{1,3}"), literal("<|tool_call:name|>" + tool.name + "<|tool_call:args|>")
    )
    return seq(head, f"t{i}-args", literal(SOLAR_END)), [args]


SOLAR = register(ToolFormat(
    "solar",
    "arguments",
    before="<|tool_calls|>",
    block=Block(openers=("<|tool_calls|>" + SOLAR_BEGIN, SOLAR_BEGIN), closer=SOLAR_END, read=_read_solar),
    call_rule=_solar_rule,
    dropped=("<|begin|>assistant", "<|content|>", "<|end|>"),
    triggers=(Trigger("<|tool_calls|>", False, SOLAR_BEGIN),),
    detect=(Detect(110, ("<|tool_call:begin|>", "<|tool_call:name|>")),),
))
