"""OpenAI tool calling, the request side: ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (and the legacy ``functions`` / ``function_call``) validated into
one ToolRequest. Pure: the grammar (call_grammar.py) and the reply parser (parser.py)
read it."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from ...wire.errors import bad_param

MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 64 * 1024  # one tool's parameters schema as JSON
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

Choice = Literal["none", "auto", "required", "function"]


def _empty_object() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema for the arguments object
    strict: bool = False

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request spells it: what a Jinja template's ``tools`` holds."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: Choice  # "function": only ``function`` may be called, and it must be
    function: str | None  # the named function of choice "function"
    parallel: bool  # whether one reply may hold several calls

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools a reply may call: the named one for choice "function", else all."""
        if self.choice == "function":
            return tuple(t for t in self.tools if t.name == self.function)
        return self.tools

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools and how they may be called; None when it declares none. Every
    problem is a 400 naming its parameter."""
    tools_raw, functions_raw = body.get("tools"), body.get("functions")
    if tools_raw is not None and functions_raw is not None:
        raise bad_param("send tools or the legacy functions, not both", "functions")
    legacy = tools_raw is None and functions_raw is not None
    if legacy:
        tools = _functions(functions_raw)
        choice_key, choice_raw = "function_call", body.get("function_call")
        if body.get("tool_choice") is not None:
            raise bad_param("tool_choice goes with tools; with functions send function_call", "tool_choice")
    else:
        tools = _tools(tools_raw)
        choice_key, choice_raw = "tool_choice", body.get("tool_choice")
        if body.get("function_call") is not None:
            raise bad_param("function_call goes with functions; with tools send tool_choice", "function_call")
    choice, function = _choice(choice_raw, choice_key, legacy)
    parallel_raw = body.get("parallel_tool_calls")
    if parallel_raw is not None and not isinstance(parallel_raw, bool):
        raise bad_param("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if not tools:
        if choice in ("required", "function"):
            what = f"{choice_key} names {function!r}" if function else f"{choice_key} {choice!r}"
            raise bad_param(f"{what}, but the request declares no {'functions' if legacy else 'tools'}", choice_key)
        return None
    if function is not None and all(t.name != function for t in tools):
        raise bad_param(f"{choice_key} names {function!r}, which is not among the declared tools", choice_key)
    # The legacy API's reply holds one function_call at most.
    parallel = False if legacy else (True if parallel_raw is None else parallel_raw)
    return ToolRequest(tools=tools, choice=choice, function=function, parallel=parallel)


def _tools(raw: Any) -> tuple[Tool, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad_param("tools must be an array", "tools")
    out: list[Tool] = []
    for i, entry in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(entry, dict):
            raise bad_param(f"{where} must be an object", where)
        if entry.get("type") != "function":
            raise bad_param(f"{where}.type must be \"function\", got {entry.get('type')!r}", f"{where}.type")
        fn = entry.get("function")
        if not isinstance(fn, dict):
            raise bad_param(f"{where}.function must be an object (name, description, parameters)", f"{where}.function")
        out.append(_tool(fn, f"{where}.function"))
    return _checked(out, "tools")


def _functions(raw: Any) -> tuple[Tool, ...]:
    if not isinstance(raw, list):
        raise bad_param("functions must be an array", "functions")
    out: list[Tool] = []
    for i, fn in enumerate(raw):
        if not isinstance(fn, dict):
            raise bad_param(f"functions[{i}] must be an object", f"functions[{i}]")
        out.append(_tool(fn, f"functions[{i}]"))
    return _checked(out, "functions")


def _tool(fn: dict[str, Any], where: str) -> Tool:
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_param(f"{where}.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name!r}", f"{where}.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_param(f"{where}.description must be a string", f"{where}.description")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = _empty_object()
    elif not isinstance(parameters, dict):
        raise bad_param(f"{where}.parameters must be a JSON schema (an object)", f"{where}.parameters")
    size = len(json.dumps(parameters, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > MAX_SCHEMA_BYTES:
        raise bad_param(f"{where}.parameters is {size} bytes of JSON; at most "
                        f"{MAX_SCHEMA_BYTES}", f"{where}.parameters")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_param(f"{where}.strict must be a boolean", f"{where}.strict")
    return Tool(name=name, description=description, parameters=parameters, strict=bool(strict))


def _checked(tools: list[Tool], key: str) -> tuple[Tool, ...]:
    if len(tools) > MAX_TOOLS:
        raise bad_param(f"{key} declares {len(tools)}; at most {MAX_TOOLS}", key)
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.name in seen:
            raise bad_param(
                f"{key} declares {t.name!r} twice", f"{key}[{i}]" + (".function.name" if key == "tools" else ".name")
            )
        seen.add(t.name)
    return tuple(tools)


def _choice(raw: Any, key: str, legacy: bool) -> tuple[Choice, str | None]:
    if raw is None:
        return "auto", None
    if isinstance(raw, str):
        allowed = ("none", "auto") if legacy else ("none", "auto", "required")
        if raw not in allowed:
            raise bad_param(f"{key} must be one of {', '.join(allowed)} or name a function, got {raw!r}", key)
        return raw, None  # type: ignore[return-value]  # one of the literals, checked above
    if not isinstance(raw, dict):
        raise bad_param(f"{key} must be a string or an object naming a function", key)
    if legacy:
        name = raw.get("name")
    else:
        if raw.get("type") != "function" or not isinstance(raw.get("function"), dict):
            raise bad_param(f'{key} must be {{"type": "function", "function": {{"name": ...}}}}', key)
        name = raw["function"].get("name")
    if not isinstance(name, str) or not name:
        raise bad_param(f"{key} must name a function", key)
    return "function", name
