"""Cohere's JSON lists of calls: Command R7B and Cohere2MoE
(``<|START_ACTION|>[{"tool_call_id": "0", "tool_name": N, "parameters": {...}}]<|END_ACTION|>``,
the id the model's), and Command R+ (``Action:`` and a JSON code block of the calls, no ids).
Pure."""

from __future__ import annotations

from collections.abc import Callable

from ...structured import SchemaExpr, literal, regex, seq
from ..markup import json_items
from ..tools import Tool
from .param_rules import json_rule
from .roster import register
from .toolformat import Block, Call, Detect, Props, ToolFormat, Trigger


def _read_cohere(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    """Cohere's JSON list of calls; its id is the model's ``tool_call_id``."""
    if (items := json_items(body)) is None:
        return None
    calls: list[Call] = []
    for item in items:
        if not isinstance(item, dict):
            return None
        name, args, given = item.get("tool_name"), item.get("parameters", {}), item.get("tool_call_id")
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            return None
        calls.append((name, args, str(given) if given is not None else None))
    return calls


def _cohere_rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
    args = f"t{i}-args: {schema(tool.parameters, f'tools[{i}].function.parameters')}"
    head = seq(
        literal('{"tool_call_id": "'), regex("[0-9]{1,3}"), literal(f'", "tool_name": "{tool.name}", "parameters": ')
    )
    return seq(head, f"t{i}-args", literal("}")), [args]


COHERE = register(ToolFormat(
    "cohere",
    "parameters",
    before="<|START_ACTION|>[\n    ",
    between=",\n    ",
    after="\n]<|END_ACTION|>",
    block=Block(openers=("<|START_ACTION|>",), closer="<|END_ACTION|>", read=_read_cohere, call_end="}",
                list_close="]"),
    call_rule=_cohere_rule,
    dropped=("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>"),  # R7B's, Cohere2MoE's
    triggers=(Trigger("<|START_ACTION|>", False, '[\n    {"tool_call_id": "'),),
    detect=(Detect(80, ("<|START_ACTION|>", "<|END_ACTION|>")),),
))
COMMAND_R_PLUS = register(ToolFormat(
    "command_r_plus",
    "parameters",
    before="Action:\n```json\n[\n    ",
    between=",\n    ",
    after="\n]\n```",
    block=Block(openers=("Action:\n```json",), closer="```", read=_read_cohere, call_end="}", list_close="]"),
    call_rule=json_rule(lambda t: literal(f'{{"tool_name": "{t.name}", "parameters": '), "}"),
    dropped=("<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
    triggers=(Trigger("Action:\n```json", False, '\n[\n    {"tool_name": "'),),
    detect=(Detect(90, ("directly-answer", "Action:", "```json")),),
))
