"""What a Jinja template does with what it is given, learnt by rendering it, as llama.cpp's
caps check does (common/jinja/caps.cpp): whether it prints a system message, the tools,
earlier tool calls, and a call's arguments as an object. Sniffing the source guesses; a
probe render sees. Markers stand in for the values, so a probe reads the output only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .jinja import compile_template, date_context

_SYS, _TOOL, _ARG, _CALL = "SYS_PROBE_7f3a", "tool_probe_7f3a", "arg_probe_7f3a", "call_probe_7f3a"
_THOUGHT = "THOUGHT_PROBE_7f3a"
# What llama-server sets for its default preserve_reasoning kwarg (caps_apply_preserve_reasoning).
PRESERVE_REASONING = {"preserve_thinking": True, "clear_thinking": False,
                      "truncate_history_thinking": False, "drop_thinking": False}


@dataclass(frozen=True, slots=True)
class Probed:
    system_role: bool  # a system message's content reaches the prompt
    shows_tools: bool  # the tools' names reach the prompt
    renders_tool_calls: bool  # an earlier call's name reaches the prompt
    object_arguments: bool  # a call's arguments are read as an object (their values printed)
    thinks: bool  # it prints a reply's reasoning or opens a think block: enable_thinking defaults on
    plain: str = ""  # what a system and a user message print (its turn markup), "" if it refused


def _tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": _TOOL, "description": "Tool description",
        "parameters": {"type": "object", "properties": {"arg": {"type": "string", "description": "Arg"}},
                       "required": ["arg"]}}}]


def _round_trip(arguments: Any) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "User message"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": _CALL, "arguments": arguments}, "id": "call00001"}]},
        {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "The tool response was 'tool response'"},
        {"role": "user", "content": "User message"},
    ]


def _render(
    source: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, **extra: Any
) -> str | None:
    ctx: dict[str, Any] = {"messages": messages, "bos_token": "", "eos_token": "", "enable_thinking": True,
                           "add_generation_prompt": True, **date_context(), **extra}
    if tools is not None:
        ctx["tools"] = tools
    try:
        return compile_template(source).render(**ctx)
    except Exception:  # a template that refuses the probe tells us nothing
        return None


def probe(source: str) -> Probed:
    plain = out = _render(source, [{"role": "system", "content": _SYS}, {"role": "user", "content": "User message"}], None)
    system_role = out is not None and _SYS in out  # Gemma's raise on a system message
    with_objects = _render(source, _round_trip({"arg": _ARG}), _tools())
    # A template that prints the object whole as Python would (``{{ arguments }}``) wants text.
    object_args = with_objects is not None and _ARG in with_objects and f"{{'arg': '{_ARG}'}}" not in with_objects
    out = with_objects if object_args else _render(source, _round_trip(f'{{"arg": "{_ARG}"}}'), _tools())
    listed = _render(source, [{"role": "user", "content": "User message"}], _tools())
    return Probed(
        system_role=system_role,
        shows_tools=listed is not None and _TOOL in listed,
        renders_tool_calls=out is not None and _CALL in out,
        object_arguments=object_args,
        thinks=_thinks(source),
        plain=plain or "",
    )


def _thinks(source: str) -> bool:
    """Whether the template has a reasoning form (llama-server then turns enable_thinking on
    by default): it prints a reply's reasoning_content, or its generation prompt opens a think
    block only when thinking is enabled."""
    reply = [{"role": "user", "content": "User message"},
             {"role": "assistant", "content": "Assistant message", "reasoning_content": _THOUGHT}]
    calling = [reply[0], {**reply[1], "content": "", "tool_calls": _round_trip(f'{{"arg": "{_ARG}"}}')[1]["tool_calls"]}]
    for messages, tools in ((reply, None), (calling, _tools())):  # some print it only before a call
        shown = _render(source, messages, tools, add_generation_prompt=False, **PRESERVE_REASONING)
        if shown is not None and _THOUGHT in shown:
            return True
    ask = [{"role": "user", "content": "User message"}]
    on, off = _render(source, ask, None, enable_thinking=True), _render(source, ask, None, enable_thinking=False)
    return on is not None and off is not None and on != off and "<think>" in on.replace(off, "", 1)
