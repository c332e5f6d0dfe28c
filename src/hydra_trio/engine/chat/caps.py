"""What a chat template can do, read once from its source: the one place that sniffs a
template. Everything that depends on it (the tool grammar's syntax, the reply parser's
markers, whether earlier calls are rendered by the template or described for it, how their
arguments are handed to it, whether a reply may open with reasoning) reads ``TemplateCaps``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .families import GENERIC, ToolFormat, by_name, detection_order
from .jinja import compile_template, date_context
from .reasoning import CLOSE, OPEN
from .templates import ChatTemplate


@dataclass(frozen=True, slots=True)
class TemplateCaps:
    tool_format: ToolFormat  # how the template writes calls (generic: it has no syntax of its own)
    thinks: bool  # it has think tags: a reply may open with reasoning
    renders_tool_calls: bool  # it prints an assistant message's earlier ``tool_calls``
    object_arguments: bool  # it prints a call's arguments as an object (``| tojson``, ``.items()``)
    think_tags: tuple[str, str] = (OPEN, CLOSE)  # the markers around its reasoning
    system_role: bool = True  # it prints a system message (else it is merged into the next, as llama.cpp)
    shows_tools: bool = False  # it lists the request's tools itself
    thinking_default: bool = False  # enable_thinking when the request does not say (as llama-server)
    own_template: bool = False  # the model's or the user's Jinja: rendered as llama-server does, nothing added
    turn_text: str = ""  # what a plain conversation prints: its turn markup (not tool or think syntax)
    think_lead: bool = False  # its open tag is the reasoning's first words (Apriel 1.6's), reported with it

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
            "think_tags": list(self.think_tags),
            "system_role": self.system_role,
            "shows_tools": self.shows_tools,
            "thinking_default": self.thinking_default,
        }


APRIEL_LEAD = "Here are my reasoning steps:"
# Reasoning markers other than <think>: the first found in the source is the template's.
_THINK_TAGS: tuple[tuple[str, str], ...] = (
    ("<seed:think>", "</seed:think>"),
    ("<mm:think>", "</mm:think>"),
    ("[THINK]", "[/THINK]"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),  # Cohere
    ("<|inner_prefix|>", "<|inner_suffix|>"),  # Apertus' deliberation
    ("<|channel>thought", "<channel|>"),  # Gemma 4
    ("<|think|>", "<|end|>"),  # Upstage Solar Open (after Gemma 4's: its templates name <|think|> too)
    (APRIEL_LEAD, "[BEGIN FINAL RESPONSE]"),  # Apriel 1.6: its prompt opens the reasoning with these words
    (OPEN, CLOSE),
)


KIMI_K3_THINK = ("<|open|>think<|sep|>", "<|close|>think<|sep|>")
HY3_THINK = ("<think:opensource>", "</think:opensource>")


def detect_format(source: str) -> ToolFormat:
    """The tool format a Jinja template's source writes calls in: the family of the first
    detection rule that holds, in the roster's order (families/roster.py); generic: none does."""
    for rule, fmt in detection_order():
        if rule.holds(source):
            return fmt
    return GENERIC


def detect_think_tags(source: str) -> tuple[str, str] | None:
    """The markers a template's reasoning is written between; None: it has none (gpt-oss's
    analysis channel and Muse Glimmer's ``to=self`` messages are their formats': the channel
    dialects of families/harmony.py and families/glimmer.py)."""
    if all(m in source for m in ("<|open|>", "<|close|>", "<|end_of_msg|>")):
        return KIMI_K3_THINK  # Kimi K3 builds its tags from these tokens
    if "<think{}>" in source and ":opensource" in source:
        return HY3_THINK  # Tencent Hy3 formats them with the suffix
    for tags in _THINK_TAGS:
        if tags[0] in source:
            return tags
    return None


def template_caps(template: ChatTemplate, tool_call_parser: str = "auto") -> TemplateCaps:
    """``template``'s capabilities; ``tool_call_parser`` (--tool-call-parser): a format's name
    overrides what the source suggests. A llama.cpp built-in renders role and content only."""
    source = template.jinja or ""
    fmt = detect_format(source) if tool_call_parser == "auto" else by_name(tool_call_parser)
    tags = detect_think_tags(source)
    if template.jinja is not None:
        # Rendered, not sniffed: what the template prints of a probe conversation (``probe``).
        seen = probe(template.jinja)
        return TemplateCaps(
            tool_format=fmt, thinks=tags is not None or fmt.channels, renders_tool_calls=seen.renders_tool_calls,
            object_arguments=seen.object_arguments, system_role=seen.system_role, shows_tools=seen.shows_tools,
            thinking_default=seen.thinks, own_template=template.source != "fallback", think_tags=tags or (OPEN, CLOSE),
            turn_text=seen.plain, think_lead=tags is not None and tags[0] == APRIEL_LEAD,
        )
    compact = source.replace(" ", "")
    return TemplateCaps(
        tool_format=fmt,
        thinks=tags is not None or fmt.channels,
        renders_tool_calls=template.jinja is not None and "tool_calls" in source,
        # Qwen, Hermes and Llama 3 print ``arguments | tojson`` or walk ``arguments.items()``;
        # others print the string as sent.
        object_arguments="arguments|tojson" in compact or "arguments.items()" in compact,
        think_tags=tags or (OPEN, CLOSE),
    )


# ---- what a template prints of probe conversations ---------------------------------------------
# What a Jinja template does with what it is given, learnt by rendering it, as llama.cpp's caps
# check does (common/jinja/caps.cpp): whether it prints a system message, the tools, earlier
# tool calls, and a call's arguments as an object. Sniffing the source guesses; a probe render
# sees. Markers stand in for the values, so a probe reads the output only.

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
    plain = out = _render(
        source, [{"role": "system", "content": _SYS}, {"role": "user", "content": "User message"}], None
    )
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
    calling = [
        reply[0],
        {**reply[1], "content": "", "tool_calls": _round_trip(f'{{"arg": "{_ARG}"}}')[1]["tool_calls"]},
    ]
    for messages, tools in ((reply, None), (calling, _tools())):  # some print it only before a call
        shown = _render(source, messages, tools, add_generation_prompt=False, **PRESERVE_REASONING)
        if shown is not None and _THOUGHT in shown:
            return True
    ask = [{"role": "user", "content": "User message"}]
    on, off = _render(source, ask, None, enable_thinking=True), _render(source, ask, None, enable_thinking=False)
    return on is not None and off is not None and on != off and "<think>" in on.replace(off, "", 1)
