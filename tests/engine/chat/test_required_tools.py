"""tool_choice "required" forces at least one call (issue 40): with Codex's kind of tool list
on the generic format, every reply is calls, never an empty list."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helpers import chat, http

CODEX_LIKE = [
    {"type": "function", "function": {"name": "shell", "parameters": {
        "type": "object",
        "properties": {
            "command": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "timeout_ms": {"type": "integer", "minimum": 1, "maximum": 600000},
        },
        "required": ["command"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "update_plan", "parameters": {
        "type": "object",
        "properties": {"plan": {"type": "array", "maxItems": 2, "items": {
            "type": "object",
            "properties": {"step": {"type": "string", "maxLength": 8},
                           "status": {"enum": ["pending", "in_progress", "completed"]}},
            "required": ["step", "status"], "additionalProperties": False}}},
        "required": ["plan"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "view_image", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 12}}, "required": ["path"]}}},
    {"type": "function",
     "function": {"name": "list_mcp_resources", "parameters": {"type": "object", "properties": {}}}},
]


async def test_required_gives_at_least_one_call(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, slots=1)
    async with http(ep) as h:
        for i, content in enumerate(("fix the bug", "run the tests", "hello", "x")):
            sampled = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": i} if i % 2 else {}
            body = await chat(h, messages=[{"role": "user", "content": content}], tools=CODEX_LIKE,
                              tool_choice="required", max_tokens=600, **sampled)
            choice = body["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            assert choice["message"]["tool_calls"], choice


def _tool(name: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "properties": props, "required": required, "additionalProperties": False}}}


# The keywords Claude Code's tool list sends (issue 40: `maximum` in tools[9] was a 400).
CLAUDE_CODE_LIKE = [
    _tool("Bash",
          {"command": {"type": "string", "maxLength": 10},
           "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": 600000}}, ["command"]),
    _tool("Read",
          {"file_path": {"type": "string", "maxLength": 10}, "offset": {"type": "integer", "minimum": 0},
           "limit": {"type": "integer", "exclusiveMinimum": 0}}, ["file_path"]),
    # pydantic's HttpUrl: a format with lengths (refused before llguidance)
    _tool("WebFetch", {"url": {"type": "string", "format": "uri", "minLength": 1, "maxLength": 40}}, ["url"]),
    _tool("WebSearch", {"query": {"type": "string", "minLength": 2, "maxLength": 9}}, ["query"]),
    _tool("Edit",
          {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}, "n": {"type": "integer", "minimum": 1, "maximum": 9}},
          ["id", "n"]),
]


async def test_claude_code_keywords_are_served_and_forced_calls_validate(start_engine: Any, tiny_model: Path) -> None:
    import json

    import jsonschema

    ep = await start_engine(tiny_model, slots=1)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in CLAUDE_CODE_LIKE}
    async with http(ep) as h:
        body = await chat(
            h, messages=[{"role": "user", "content": "hi"}], tools=CLAUDE_CODE_LIKE, tool_choice="auto", max_tokens=16
        )
        assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), body
        for name in schemas:
            choice = {"type": "function", "function": {"name": name}}
            body = await chat(
                h,
                messages=[{"role": "user", "content": "go"}],
                tools=CLAUDE_CODE_LIKE,
                tool_choice=choice,
                parallel_tool_calls=False,
                max_tokens=1200,
            )
            calls = body["choices"][0]["message"].get("tool_calls")
            assert calls, (name, body["choices"][0])
            assert calls and calls[0]["function"]["name"] == name, body
            jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schemas[name])
