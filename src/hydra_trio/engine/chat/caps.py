"""What a chat template can do, read once from its source: the one place that sniffs a
template. Everything that depends on it (the tool grammar's syntax, the reply parser's
markers, whether earlier calls are rendered by the template or described for it, how their
arguments are handed to it, whether a reply may open with reasoning) reads ``TemplateCaps``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .formats import FORMATS, GENERIC, HERMES, LLAMA3, MISTRAL, ToolFormat
from .probe import probe
from .reasoning import OPEN
from .templates import ChatTemplate


@dataclass(frozen=True, slots=True)
class TemplateCaps:
    tool_format: ToolFormat  # how the template writes calls (generic: it has no syntax of its own)
    thinks: bool  # it has think tags: a reply may open with reasoning
    renders_tool_calls: bool  # it prints an assistant message's earlier ``tool_calls``
    object_arguments: bool  # it prints a call's arguments as an object (``| tojson``, ``.items()``)
    system_role: bool = True  # it prints a system message (else it is merged into the next, as llama.cpp)
    shows_tools: bool = False  # it lists the request's tools itself
    thinking_default: bool = False  # enable_thinking when the request does not say (as llama-server)
    own_template: bool = False  # the model's or the user's Jinja: rendered as llama-server does, nothing added

    @property
    def describes_tools(self) -> bool:
        """The generic format is in use with a built-in or our ChatML fallback, which know
        nothing of tools: the tools and the reply form are described in a system message
        (llama.cpp's old generic handler). A model's or a user's Jinja template renders as
        llama-server renders it, with nothing added: where it lists no tools, llama-server
        shows the model none either."""
        return self.tool_format is GENERIC and not self.own_template

    def as_dict(self) -> dict[str, Any]:
        return {
            "tool_format": self.tool_format.name,
            "thinking": self.thinks,
            "renders_tool_calls": self.renders_tool_calls,
            "object_arguments": self.object_arguments,
            "system_role": self.system_role,
            "shows_tools": self.shows_tools,
            "thinking_default": self.thinking_default,
        }


def detect_format(source: str) -> ToolFormat:
    """The tool format a Jinja template's source writes calls in (generic: it has none)."""
    if "<tool_call>" in source:
        return HERMES
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    if "<|python_tag|>" in source or ("ipython" in source and "parameters" in source):
        return LLAMA3
    return GENERIC


def template_caps(template: ChatTemplate, tool_call_parser: str = "auto") -> TemplateCaps:
    """``template``'s capabilities; ``tool_call_parser`` (--tool-call-parser): a format's name
    overrides what the source suggests. A llama.cpp built-in renders role and content only."""
    source = template.jinja or ""
    fmt = detect_format(source) if tool_call_parser == "auto" else FORMATS[tool_call_parser]
    if template.jinja is not None:
        # Rendered, not sniffed: what the template prints of a probe conversation (probe.py).
        seen = probe(template.jinja)
        return TemplateCaps(
            tool_format=fmt, thinks=OPEN in source, renders_tool_calls=seen.renders_tool_calls,
            object_arguments=seen.object_arguments, system_role=seen.system_role, shows_tools=seen.shows_tools,
            thinking_default=seen.thinks, own_template=template.source != "fallback",
        )
    compact = source.replace(" ", "")
    return TemplateCaps(
        tool_format=fmt,
        thinks=OPEN in source,
        renders_tool_calls=template.jinja is not None and "tool_calls" in source,
        # Qwen, Hermes and Llama 3 print ``arguments | tojson`` or walk ``arguments.items()``;
        # others print the string as sent.
        object_arguments="arguments|tojson" in compact or "arguments.items()" in compact,
    )
