"""OpenAI chat request -> prompt text, through the model's own Jinja chat template."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..wire.errors import ErrorCode, ProtocolError, Status
from ..wire.jsontext import parse_json
from .toolcalls import (
    dump_arguments,
    generic_calls_json,
    tools_system_prompt,
)
from .tools import ToolRequest, parse_tools

# Used when a GGUF carries no template: ChatML, the most common convention.
FALLBACK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

_ROLES = {"system", "user", "assistant", "tool", "developer"}


class ChatRequestError(ProtocolError):
    def __init__(self, message: str) -> None:
        # Valid JSON of the wrong shape: the caller's mistake, so BAD_REQUEST.
        super().__init__(ErrorCode.BAD_JSON, message, status=Status.BAD_REQUEST)


@lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    return env.from_string(template)


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatRequestError(f"messages[{index}].content: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatRequestError(f"messages[{index}].content must be a string or a list of text parts")


def normalise_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages must be a non-empty array")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatRequestError(f"messages[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:  # an object or array is unhashable
            raise ChatRequestError(f"messages[{i}].role must be one of {sorted(_ROLES)}")
        msg = dict(m)
        msg["content"] = _content_text(m.get("content"), i)
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise ChatRequestError(f"messages[{i}].tool_calls: only assistant messages carry tool calls")
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if role == "tool" and m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
            raise ChatRequestError(f"messages[{i}].tool_call_id must be a string")
        out.append(msg)
    return out


def _tool_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    """An assistant message's earlier tool calls, as OpenAI sends them back (id, type,
    function.name, function.arguments as JSON text), with the arguments also parsed: a
    template prints them one way or the other (``template_wants_object_arguments``)."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise ChatRequestError(f"{where} must be an array")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatRequestError(f"{where}[{j}] must be an object with function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                parsed = parse_json(args.encode("utf-8", "surrogatepass"), "arguments") if args.strip() else {}
            except ProtocolError:
                raise ChatRequestError(f"{where}[{j}].function.arguments is not JSON text") from None
        elif isinstance(args, dict):
            parsed, args = args, dump_arguments(args)
        else:
            raise ChatRequestError(f"{where}[{j}].function.arguments must be a string of JSON")
        out.append({
            "id": call.get("id") if isinstance(call.get("id"), str) else f"call_{index}_{j}",
            "type": "function",
            "function": {"name": fn["name"], "arguments": args},
            "_arguments_object": parsed,
        })
    return out


def template_renders_tool_calls(template: str) -> bool:
    return "tool_calls" in template


def template_wants_object_arguments(template: str) -> bool:
    """Templates that print ``arguments | tojson`` or walk ``arguments.items()`` (Qwen,
    Hermes, Llama 3) need the arguments as an object; others print the string as sent."""
    compact = template.replace(" ", "")
    return "arguments|tojson" in compact or "arguments.items()" in compact


def tool_messages(
    messages: list[dict[str, Any]], template: str | None, tools: ToolRequest | None, *, describe: bool
) -> list[dict[str, Any]]:
    """The messages a template renders when tools are in play: with ``describe`` the tools
    and the generic reply form are described in a system message first (llama.cpp's generic
    format); a template that does not print earlier tool calls gets them as the generic JSON reply
    in the assistant's content; arguments as the template wants them."""
    source = template or ""
    wants_object = template_wants_object_arguments(source)
    renders_calls = template is not None and template_renders_tool_calls(source)
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls is not None:
            m = dict(m)
            if renders_calls:
                m["tool_calls"] = [
                    {**{k: v for k, v in c.items() if k != "_arguments_object"},
                     "function": {"name": c["function"]["name"],
                                  "arguments": c["_arguments_object"] if wants_object else c["function"]["arguments"]}}
                    for c in calls
                ]
            else:
                del m["tool_calls"]
                m["content"] = (m["content"] + "\n" if m["content"] else "") + generic_calls_json(
                    [(c["function"]["name"], c["_arguments_object"]) for c in calls]
                )
        out.append(m)
    # ``describe``: the generic format is in use, whose reply form no template teaches (ChatML
    # and the built-ins have no tool-call syntax, even where they list the tools): the system
    # message does, as llama.cpp's generic handler.
    if tools is not None and tools.choice != "none" and describe:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def render_prompt(
    request: dict[str, Any], template: str | None, *, bos_token: str, eos_token: str, describe_tools: bool = False
) -> str:
    """Prompt text for a request with ``messages`` or a plain ``prompt`` (used verbatim).
    ``describe_tools``: tools are described in a system message (``tool_messages``)."""
    if "messages" in request:
        messages = normalise_messages(request["messages"])
        add_gen = request.get("add_generation_prompt", True)
        if not isinstance(add_gen, bool):
            raise ChatRequestError("add_generation_prompt must be a boolean")
        tool_request = parse_tools(request)
        messages = tool_messages(messages, template or FALLBACK_TEMPLATE, tool_request, describe=describe_tools)
        try:
            text = compile_template(template or FALLBACK_TEMPLATE).render(
                messages=messages,
                tools=[t.as_openai() for t in tool_request.tools] if tool_request is not None else None,
                add_generation_prompt=add_gen,
                bos_token=bos_token,
                eos_token=eos_token,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatRequestError(f"chat template failed: {exc}") from None
        return text
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return prompt
    raise ChatRequestError("request needs 'messages' (array) or 'prompt' (string)")
