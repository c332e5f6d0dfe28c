"""Tool-call formats: how a model writes its calls, the one home of each syntax. Pure.

A ToolFormat's fields are read by both readers of that syntax: ``parser.ReplyParser`` (its
markers) and ``call_grammar.tools_grammar`` (the grammar and lazy triggers that make a model write it),
so what the grammar makes a model write is what the parser takes as a call. Which format a
template writes is decided in ``caps.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..structured import trigger_pattern
from . import families, harmony, pythonic
from .families import Block
from .tools import ToolRequest

# How the grammar writes a call's JSON, up to the tool's name: ``{"name": "N", "<args>": {...}}``
# (the spacing of the models' own examples). A lazy trigger may land inside this text.
CALL_PREFIX = '{"name": "'


@dataclass(frozen=True)
class Trigger:
    """A literal whose appearance in the reply starts the tool grammar (``auto``)."""

    text: str
    at_start: bool  # only as the reply's first non-whitespace text
    then: str  # the fixed text the grammar writes right after it

    @property
    def pattern(self) -> str:
        """The trigger as the lazy grammar's pattern (structured/triggers.py)."""
        return trigger_pattern(self.text, self.at_start, self.then)


@dataclass(frozen=True)
class ToolFormat:
    name: str  # hermes | llama3 | mistral | granite | generic | a family's (FORMATS)
    args_key: str  # the call object's key for the arguments
    # What the parser looks for:
    opener: str = ""  # a literal that starts calls anywhere in the text ("": none)
    closer: str = ""  # a literal after each call's JSON
    at_start: bool = False  # a JSON object opening the reply is a call (or the calls' object)
    listed: bool = False  # after the opener, the calls are one JSON array
    list_key: str = ""  # the calls are this key's array of one JSON object (generic)
    separator: str = ""  # between one call's JSON and the next (llama3's ";")
    # What the grammar writes: before all calls, around each, between two, after all.
    before: str = ""
    before_optional: bool = False
    call_open: str = ""
    call_close: str = ""
    between: str = ""
    after: str = ""
    triggers: tuple[Trigger, ...] = ()
    # A family whose calls are blocks of its own markup (families.py): the parser reads them
    # with ``block.read`` and the grammar writes each call with ``block.call_rule``.
    block: Block | None = None
    # Functionary v3.2's recipients: each message starts at ``opener`` with its recipient's
    # line (the reply's first one right at its start: the prompt ends with the opener);
    # ``all`` is content (the line dropped), a tool's name a call whose arguments' JSON follows.
    recipient: str = ""
    dropped: tuple[str, ...] = ()  # markup around content (a block family's), removed from it
    # A trigger per declared tool (text, then), "{name}" its name: where the call's start names it
    tool_trigger: tuple[str, str] = ()
    # A channel dialect (harmony.py), whose messages carry reasoning, content and calls alike:
    # "harmony" (gpt-oss), "glimmer" (Muse Glimmer); its splitter reads the reply, not the scanner.
    channels: str = ""

    @property
    def harmony(self) -> bool:
        return self.channels == "harmony"


def _json_list(name: str, opener: str, closer: str = "") -> ToolFormat:
    """A format whose calls are one JSON list after ``opener`` (and before ``closer``):
    ``OPENER[{"name": ..., "arguments": {...}}, ...]CLOSER``."""
    return ToolFormat(
        name,
        "arguments",
        opener=opener,
        closer=closer,
        listed=True,
        before=opener + "[",
        between=", ",
        after="]" + closer,
        triggers=(Trigger(opener, False, "[" + CALL_PREFIX),),
    )


HERMES = ToolFormat(
    "hermes",
    "arguments",
    opener="<tool_call>",
    closer="</tool_call>",
    call_open="<tool_call>\n",
    call_close="\n</tool_call>",
    between="\n",
    triggers=(Trigger("<tool_call>", False, "\n" + CALL_PREFIX),),
)
LLAMA3 = ToolFormat(
    "llama3",
    "parameters",
    opener="<|python_tag|>",
    at_start=True,
    separator=";",
    before="<|python_tag|>",
    before_optional=True,
    between="; ",
    triggers=(Trigger("<|python_tag|>", False, CALL_PREFIX), Trigger('{"name"', True, CALL_PREFIX[len('{"name"'):])),
)
MISTRAL = _json_list("mistral", "[TOOL_CALLS]")
# IBM Granite 3.3: "respond only with <|tool_call|> followed by a JSON list of tools used"
GRANITE = _json_list("granite", "<|tool_call|>")
# NVIDIA Nemotron Nano v2: <TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>
NEMOTRON = _json_list("nemotron", "<TOOLCALL>", "</TOOLCALL>")
# ServiceNow Apriel 1.5 and 1.6: <tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>
APRIEL = _json_list("apriel", "<tool_calls>", "</tool_calls>")
# Functionary v3.2: ">>>NAME\n{arguments}" (the prompt ends with ">>>"), ">>>all\n" before content
FUNCTIONARY = ToolFormat(
    "functionary",
    "arguments",
    opener=">>>",
    recipient="all",
    before=">>>",
    before_optional=True,
    between=">>>",
    triggers=(Trigger(">>>", False, ""),),  # its patterns name the request's tools: grammar.recipient_patterns
)
# Fireworks' firefunction v2: " functools[{"name": ..., "arguments": {...}}, ...]" (no closing marker;
# the grammar writes it from "functools[", its trigger, on: what a lazy grammar is fed starts there)
FIREFUNCTION = ToolFormat(
    "firefunction",
    "arguments",
    opener="functools",
    listed=True,
    before="functools[",
    between=", ",
    after="]",
    triggers=(Trigger("functools[", False, CALL_PREFIX),),
)
# GigaChat3: its "function call" role's message after the reply's (one call; the template shows no second)
GIGA3_CALL = "<|message_sep|>\n\nfunction call<|role_sep|>"
GIGACHAT3 = ToolFormat(
    "gigachat3",
    "arguments",
    opener=GIGA3_CALL,
    before=GIGA3_CALL + "\n",
    between=GIGA3_CALL + "\n",
    triggers=(Trigger(GIGA3_CALL, False, "\n" + CALL_PREFIX),),
)
# GigaChat3.1: <|function_call|>{"name": ..., "arguments": {...}}
GIGACHAT3_1 = ToolFormat(
    "gigachat3_1",
    "arguments",
    opener="<|function_call|>",
    before="<|function_call|>",
    between="<|function_call|>",
    triggers=(Trigger("<|function_call|>", False, CALL_PREFIX),),
)
GENERIC = ToolFormat(
    "generic",
    "arguments",
    at_start=True,
    list_key="tool_calls",
    before='{"tool_calls": [',
    between=", ",
    after="]}",
    triggers=(Trigger('{"tool_calls"', True, ": [" + CALL_PREFIX),),
)
QWEN3_CODER = ToolFormat(
    "qwen3_coder",
    "arguments",
    between="\n",
    block=families.QWEN_XML,
    triggers=(Trigger("<tool_call>", False, "\n<function="),),
)
SEED_OSS = ToolFormat(
    "seed_oss",
    "arguments",
    between="\n",
    block=families.SEED_XML,
    triggers=(Trigger("<seed:tool_call>", False, "\n<function="),),
)
GLM = ToolFormat("glm", "arguments", between="\n", block=families.GLM_XML, triggers=(Trigger("<tool_call>", False, ""),))
KIMI_K2 = ToolFormat(
    "kimi_k2",
    "arguments",
    before="<|tool_calls_section_begin|>",
    after="<|tool_calls_section_end|>",
    block=families.KIMI,
    triggers=(Trigger("<|tool_calls_section_begin|>", False, "<|tool_call_begin|>functions."),),
)
DEEPSEEK = ToolFormat(
    "deepseek",
    "arguments",
    before=families.DS_BEGIN,
    after=families.DS_END,
    block=families.DEEPSEEK,
    triggers=(Trigger(families.DS_BEGIN, False, "<｜tool▁call▁begin｜>"),),
)
MINIMAX = ToolFormat(
    "minimax",
    "arguments",
    before="<minimax:tool_call>",
    after="</minimax:tool_call>",
    block=families.MINIMAX,
    triggers=(Trigger("<minimax:tool_call>", False, '\n<invoke name="'),),
)
# MiniMax M1: <tool_calls>\n{"name": ..., "arguments": {...}}\n...\n</tool_calls>, one call's JSON a line
MINIMAX_M1 = ToolFormat(
    "minimax_m1",
    "arguments",
    before="<tool_calls>\n",
    between="\n",
    after="\n</tool_calls>",
    block=families.MINIMAX_M1,
    triggers=(Trigger("<tool_calls>", False, "\n" + CALL_PREFIX),),
)
DEEPSEEK_DSML = ToolFormat(
    "deepseek_dsml",
    "arguments",
    before="<｜DSML｜function_calls>",
    after="</｜DSML｜function_calls>",
    block=families.DSML,
    triggers=(Trigger("<｜DSML｜function_calls>", False, '\n<｜DSML｜invoke name="'),),
)
GEMMA4 = ToolFormat(
    "gemma4", "arguments", block=families.GEMMA4, triggers=(Trigger("<|tool_call>", False, "call:"),)
)
# Cohere Command R7B and Cohere2MoE: a JSON list of calls between the action markers
COHERE = ToolFormat(
    "cohere",
    "parameters",
    before="<|START_ACTION|>[\n    ",
    between=",\n    ",
    after="\n]<|END_ACTION|>",
    block=families.COHERE,
    dropped=("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>"),  # R7B's, Cohere2MoE's
    triggers=(Trigger("<|START_ACTION|>", False, '[\n    {"tool_call_id": "'),),
)
# Apertus: a JSON list of {"NAME": {...arguments...}} between its tool markers
APERTUS = ToolFormat(
    "apertus",
    "arguments",
    before="<|tools_prefix|>[",
    between=", ",
    after="]<|tools_suffix|>",
    block=families.APERTUS,
    triggers=(Trigger("<|tools_prefix|>", False, '[{"'),),
)
# MiniCPM5: <function name="N"><param name="K">V</param></function>, a call a line
MINICPM5 = ToolFormat(
    "minicpm5", "arguments", between="\n", block=families.MINICPM5, triggers=(Trigger("<function", False, ' name="'),)
)
# Upstage Solar Open: each call with the model's id, name and JSON arguments between its markers;
# its content's <|content|>...<|end|> wrapper (llama.cpp's) and the assistant header a reply repeats
# after its reasoning are dropped
SOLAR = ToolFormat(
    "solar",
    "arguments",
    before="<|tool_calls|>",
    block=families.SOLAR,
    dropped=("<|begin|>assistant", "<|content|>", "<|end|>"),
    triggers=(Trigger("<|tool_calls|>", False, families.SOLAR_BEGIN),),
)
# Tencent Hy3: GLM's tags with ":opensource" (families.HY3), the calls in its section, one a line
HY3_OPEN, HY3_CLOSE = "<tool_calls:opensource>", "</tool_calls:opensource>"
HY3 = ToolFormat(
    "hy3",
    "arguments",
    before=HY3_OPEN + "\n",
    between="\n",
    after="\n" + HY3_CLOSE,
    block=families.HY3,
    dropped=(HY3_OPEN, HY3_CLOSE),  # the section around the calls
    triggers=(Trigger(HY3_OPEN, False, "\n<tool_call:opensource>"),),
)
# Kimi K3: XTML tags; its content's response and message tags are dropped
KIMI_K3 = ToolFormat(
    "kimi_k3",
    "arguments",
    before="<|open|>tools<|sep|>",
    after="<|close|>tools<|sep|>",
    block=families.KIMI_K3,
    dropped=("<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|close|>message<|sep|>"),
    triggers=(Trigger("<|open|>tools<|sep|>", False, '<|open|>call tool="'),),
)
# LFM2 and LFM2.5: Python-style calls in a list between the call markers
LFM2 = ToolFormat(
    "lfm2",
    "arguments",
    before="<|tool_call_start|>[",
    between=", ",
    after="]<|tool_call_end|>",
    block=pythonic.LFM2,
    triggers=(Trigger("<|tool_call_start|>", False, "["),),
)
# Cohere Command R+: "Action:" and a JSON code block of the calls (Cohere's list, no ids)
COMMAND_R_PLUS = ToolFormat(
    "command_r_plus",
    "parameters",
    before="Action:\n```json\n[\n    ",
    between=",\n    ",
    after="\n]\n```",
    block=families.COMMAND_R_PLUS,
    dropped=("<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
    triggers=(Trigger("Action:\n```json", False, '\n[\n    {"tool_name": "'),),
)
# gpt-oss: one call per reply (the model stops at ``<|call|>``); its grammar is harmony.py's.
HARMONY = ToolFormat(
    "harmony",
    "arguments",
    channels="harmony",
    triggers=(Trigger("<|channel|>commentary to=functions.", False, ""),),
)
# Muse Glimmer: each call its own message to the tool (`` to=NAME<|message|><atem:function_calls>...``),
# the next after ``<|eom|><|start|>assistant``; under auto the grammar starts where a message to a
# declared tool does (``tool_trigger``), as llama.cpp's pattern skips ``self`` and ``user``.
GLIMMER = ToolFormat(
    "muse_glimmer",
    "arguments",
    between="<|eom|><|start|>assistant",
    block=harmony.ATEM,
    channels="glimmer",
    tool_trigger=(" to={name}<|message|>", "<atem:function_calls>"),
)
FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (HERMES, LLAMA3, MISTRAL, GRANITE, NEMOTRON, APRIEL, FIREFUNCTION, FUNCTIONARY, GIGACHAT3, GIGACHAT3_1, GENERIC, QWEN3_CODER, SEED_OSS, GLM, KIMI_K2, DEEPSEEK, DEEPSEEK_DSML, MINIMAX, MINIMAX_M1, GEMMA4, COHERE, APERTUS, MINICPM5, SOLAR, KIMI_K3, HY3, LFM2, COMMAND_R_PLUS, HARMONY, GLIMMER)
}


HARMONY_MARKS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")


def syntax_text(fmt: ToolFormat) -> tuple[str, ...]:
    """Every literal the format's calls are written with (markers, and the fixed text the
    grammar writes): a model's special token spelled inside one is part of the syntax, so a
    reply shows it as text for the parser (as llama-server's ``preserved_tokens``)."""
    parts = [fmt.opener, fmt.closer, fmt.before, fmt.call_open, fmt.call_close, fmt.after]
    parts += [t.text + t.then for t in fmt.triggers]
    if fmt.block is not None:
        parts += [*fmt.block.openers, fmt.block.closer, fmt.block.tail, *fmt.block.closers, *fmt.dropped]
    if fmt.harmony:
        parts += HARMONY_MARKS
    if fmt.channels == "glimmer":
        parts += harmony.GLIMMER_MARKS
    return tuple(p for p in parts if p)


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
    """The one spelling of a call's arguments."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def generic_calls_json(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Earlier calls ``(name, arguments)`` as the generic format's reply, for a template with
    no tool syntax to show the model what it called (the spacing its grammar writes)."""
    return json.dumps({GENERIC.list_key: [{"name": n, GENERIC.args_key: a} for n, a in calls]}, ensure_ascii=False)
