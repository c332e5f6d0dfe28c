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
            "properties": {"step": {"type": "string", "maxLength": 8}, "status": {"enum": ["pending", "in_progress", "completed"]}},
            "required": ["step", "status"], "additionalProperties": False}}},
        "required": ["plan"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "view_image", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 12}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "list_mcp_resources", "parameters": {"type": "object", "properties": {}}}},
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
