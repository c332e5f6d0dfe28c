"""OpenAI chat request -> prompt text, through the model's own Jinja chat template."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..wire.errors import ErrorCode, ProtocolError, Status

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
        out.append(msg)
    return out


def render_prompt(request: dict[str, Any], template: str | None, *, bos_token: str, eos_token: str) -> str:
    """Prompt text for a request with ``messages`` or a plain ``prompt`` (used verbatim)."""
    if "messages" in request:
        messages = normalise_messages(request["messages"])
        tools = request.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ChatRequestError("tools must be an array")
        add_gen = request.get("add_generation_prompt", True)
        if not isinstance(add_gen, bool):
            raise ChatRequestError("add_generation_prompt must be a boolean")
        try:
            text = compile_template(template or FALLBACK_TEMPLATE).render(
                messages=messages,
                tools=tools or None,
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
