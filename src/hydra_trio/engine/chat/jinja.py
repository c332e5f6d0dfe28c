"""The Jinja environment chat templates render in, as llama.cpp's own Jinja runtime offers
it: ``raise_exception``, ``strftime_now``, ``tojson`` with its options, loop controls
(``break``/``continue``), transformers' ``{% generation %}`` blocks (ignored), sandboxed; the
variables llama-server adds (``date_string``, ``datetime``); and the ChatML fallback."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import SandboxedEnvironment

# Used when a GGUF carries no template: ChatML, the most common convention.
FALLBACK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


class GenerationBlocks(Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (marks the assistant's tokens
    for training masks): rendered as its body, as llama.cpp ignores the tags."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class LenientUndefined(jinja2.ChainableUndefined):
    """An undefined value as llama.cpp's runtime treats it: its attributes are undefined too,
    it prints as nothing and adds as nothing (``functions + '...'`` where a template never set
    ``functions``), so a template that reads a name llama-server does not give renders there."""

    def _add(self, other: Any) -> Any:
        return other

    __add__ = __radd__ = _add  # type: ignore[assignment]


def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
           separators: Any = None, sort_keys: bool = False) -> str:
    """llama.cpp's ``tojson``: non-ASCII kept unless asked, Python's separators."""
    seps = tuple(separators) if separators else None
    return json.dumps(value, ensure_ascii=bool(ensure_ascii), indent=indent, separators=seps,
                      sort_keys=bool(sort_keys), default=_json_default)


def _json_default(value: Any) -> Any:
    # ``tools | map(attribute='function') | tojson``: a filter's generator is a list there.
    if isinstance(value, jinja2.Undefined):
        return None
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"{type(value).__name__} is not JSON serializable") from None


def safe(value: Any) -> Any:
    """``| safe`` as llama.cpp has it: the value itself. (jinja2's Markup would HTML-escape
    every string added to it, though nothing here is HTML.)"""
    return value


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def date_context() -> dict[str, str]:
    """The dates llama-server gives every template (common_chat_extra_context)."""
    now = datetime.now()
    return {"datetime": now.strftime("%b %d %Y"), "date_string": now.strftime("%d %b %Y")}


@lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
    """``template``'s source compiled (jinja2's TemplateError for bad syntax)."""
    return _environment().from_string(template)


def _environment() -> SandboxedEnvironment:
    # Sandboxed (no reaching Python internals) but lists mutable: Kimi's templates append.
    env = SandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationBlocks],
        undefined=LenientUndefined,
    )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = tojson
    env.filters["safe"] = safe
    return env


# What a template finds in its environment (jinja2's range, dict, namespace, ... and
# llama.cpp's raise_exception, strftime_now): a request's template kwargs may not shadow them.
TEMPLATE_GLOBALS = frozenset(_environment().globals)
