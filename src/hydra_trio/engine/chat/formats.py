"""Tool-call formats as the chat room reads them: the roster's table (``FORMATS``, every
family of families/, each the one home of its syntax), the names --tool-call-parser takes, the
generic form a template with no syntax of its own falls back to (its system prompt, earlier
calls in its JSON), and the one spelling of a call's arguments. Which format a template writes
is decided in ``caps.py``. Pure."""

from __future__ import annotations

import json
from typing import Any

from .families import GENERIC, ToolFormat, formats
from .tools import ToolRequest

FORMATS: dict[str, ToolFormat] = formats()  # every registered family by name
TOOL_CALL_PARSERS: tuple[str, ...] = ("auto", *FORMATS)  # --tool-call-parser's choices


def tools_system_prompt(req: ToolRequest) -> str:
    """A system message describing the tools and the generic reply form, for templates with
    no tool syntax (as llama.cpp's generic handler does)."""
    tools = [
        {"name": t.name, **({"description": t.description} if t.description else {}), "parameters": t.parameters}
        for t in req.callable
    ]
    form = '{"tool_calls": [{"name": "<tool name>", "arguments": {<the arguments, a JSON object>}}]}'
    if req.choice == "function":
        must = f"You must call {req.function}."
    elif req.choice == "required":
        must = "You must call at least one tool."
    else:
        must = "If no tool is needed, reply in plain text instead."
    many = "The list may hold several calls." if req.parallel else "Call one tool at a time: the list holds one call."
    return (
        "You can call the following tools; each one's parameters are a JSON schema:\n"
        + json.dumps(tools, ensure_ascii=False)
        + f"\n\nTo call tools, reply with this JSON object and nothing else:\n{form}\n{many} {must}"
    )


def dump_arguments(value: dict[str, Any]) -> str:
    """The one spelling of a call's arguments (JSON: no NaN or Infinity)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def written_arguments(value: dict[str, Any]) -> str | None:
    """A parsed call's arguments as they go out (``dump_arguments``); None when they cannot be
    written as UTF-8 JSON (a lone surrogate a ``\\ud800`` escape made, a Python-style call's
    ``1e999``), so the call is not one."""
    try:
        text = dump_arguments(value)
        text.encode("utf-8")
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return text


def generic_calls_json(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Earlier calls ``(name, arguments)`` as the generic format's reply, for a template with
    no tool syntax to show the model what it called (the spacing its grammar writes)."""
    return json.dumps({GENERIC.list_key: [{"name": n, GENERIC.args_key: a} for n, a in calls]}, ensure_ascii=False)
