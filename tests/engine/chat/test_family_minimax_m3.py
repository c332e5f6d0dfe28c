"""MiniMax M3's tool calls (engine/chat/families/minimax_m3.py), as llama.cpp's tests expect them
for its template (tests/test-chat.cpp, models/templates/MiniMax-M3.jinja), restated: every tag
after ``]<]minimax[>[``, a parameter's name its tag, objects and arrays expanded into elements,
a value that may be a string its text whatever it holds. Its replies whole and split anywhere,
``auto`` picking it from the template's markers before Hermes' ``<tool_call>`` (which its
template holds too), and its grammar writing what the template prints. CASES, write_calls and
XML_VALUES are its part of the checks every family goes through (tests/family_examples.py).
Pure."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from hydra_trio.engine.chat import (
    ChatTemplate,
    ReplyParser,
    parse_reply,
    parse_tools,
    template_caps,
)
from hydra_trio.engine.chat.call_grammar import tools_grammar
from hydra_trio.engine.chat.caps import detect_format, detect_think_tags
from hydra_trio.engine.chat.families import detection_order
from hydra_trio.engine.chat.formats import FORMATS
from hydra_trio.engine.structured import GuidanceCache

NS = "]<]minimax[>["
XML_VALUES = {"minimax_m3"}


def el(tag: str, inner: str) -> str:
    return f"{NS}<{tag}>{inner}{NS}</{tag}>"


def invoke(name: str, *members: str) -> str:
    return f'{NS}<invoke name="{name}">' + "".join(members) + f"{NS}</invoke>\n"


def block(*invokes: str) -> str:
    return f"{NS}<tool_call>\n" + "".join(invokes) + f"{NS}</tool_call>"


def write_calls(fmt: Any, calls: list[tuple[str, dict[str, Any]]], value: Any) -> str | None:
    """Calls as MiniMax M3 writes them, each argument's text ``value(name, key, v)``."""
    if fmt.name != "minimax_m3":
        return None
    return block(*(invoke(n, *(el(k, value(n, k, v)) for k, v in a.items())) for n, a in calls))


ONE = [("special_function", {"arg1": 1})]
TWO = [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]
# (format, reply, starts in reasoning, content, reasoning, calls), the tools test_tool_families.TOOLS'
CASES: list[tuple[str, str, bool, str, str, list[tuple[str, dict[str, Any]]]]] = [
    ("minimax_m3", "</mm:think>Hello, world!\nWhat's up?", False, "Hello, world!\nWhat's up?", "", []),  # no reasoning
    ("minimax_m3", block(invoke("get_time", el("city", "Tokyo"))), False, "", "", [("get_time", {"city": "Tokyo"})]),
    ("minimax_m3", "</mm:think>" + block(invoke("special_function", el("arg1", "1"))), False, "", "", ONE),
    ("minimax_m3", block(invoke("empty_args")), False, "", "", [("empty_args", {})]),
    ("minimax_m3",
     block(invoke("special_function", el("arg1", "1")), invoke("special_function_with_opt", el("arg1", "1"),
                                                                              el("arg2", "2"))), False, "", "", TWO),
    ("minimax_m3", "Let me call the function." + block(invoke("special_function", el("arg1", "1"))), False,
     "Let me call the function.", "", ONE),
    ("minimax_m3", block(invoke("toggle", el("enabled", "true"))), False, "", "", [("toggle", {"enabled": True})]),
    # text stays text
    ("minimax_m3", block(invoke("get_time", el("city", "42"))), False, "", "", [("get_time", {"city": "42"})]),
    ("minimax_m3", block(invoke("html", el("markup", '<a href="/x">hi</a>'))), False, "", "",
     [("html", {"markup": '<a href="/x">hi</a>'})]),
    # an array of strings and an object the schema leaves open, expanded as the template prints them
    ("minimax_m3",
     block(invoke("Calendar_create_event", el("title", "demo"),
                  el("participants", el("item", "Alice") + el("item", "Bob")),
                                el("metadata", el("priority", "high") + el("reminder", "true")))), False, "", "",
     [("Calendar_create_event",
       {"title": "demo", "participants": ["Alice", "Bob"], "metadata": {"priority": "high", "reminder": True}})]),
    # undeclared: content
    ("minimax_m3", block(invoke("nope", el("a", "1"))), False, block(invoke("nope", el("a", "1"))), "", []),
    ("minimax_m3", block(invoke("special_function", el("arg1", "1") + "stray")), False,
     block(invoke("special_function", el("arg1", "1") + "stray")), "", []),  # text between elements: not a call
]


def _tool(name: str, properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"type": "object", "properties": properties}
    if required is not None:
        params["required"] = required
    return {"type": "function", "function": {"name": name, "parameters": params}}


INT, NUM, STR = {"type": "integer"}, {"type": "number"}, {"type": "string"}
# llama.cpp's tools of these cases (tests/test-chat.cpp)
TOOLS = parse_tools({"tools": [
    _tool("get_time", {"city": STR}, ["city"]),
    _tool("get_weather", {"city": STR}, ["city"]),
    _tool("special_function", {"arg1": INT}, ["arg1"]),
    _tool("empty_args", {}),
    _tool("magic_int", {"ref": INT, "name": STR}, ["ref"]),
    _tool("amount", {"orig": NUM}, ["orig"]),
    _tool("toggle", {"enabled": {"type": "boolean"}}, ["enabled"]),
    _tool("imaginary_number", {"number": {"type": "object", "properties": {"real": NUM, "imaginary": NUM},
                                          "required": ["real", "imaginary"]}}, ["number"]),
    _tool("nested_args", {"tags": {"type": "array", "items": STR},
                          "entries": {"type": "array",
                                      "items": {"type": "object", "properties": {"id": INT, "label": STR},
                                                                 "required": ["id", "label"]}}}, ["tags", "entries"]),
    _tool("union_args", {
        "filter": {"anyOf": [{"type": "array", "items": STR},
                             {"type": "object", "properties": {"field": STR, "op": STR}, "required": ["field", "op"]}]},
        "label": {"oneOf": [STR, {"type": "object", "properties": {"text": STR}}]},
        "limit": {"oneOf": [INT, {"type": "object", "properties": {"max": INT}, "required": ["max"]}]},
    }),
], "parallel_tool_calls": True})
THINK = ("<mm:think>", "</mm:think>")

# llama.cpp's MiniMax-M3 cases: (reply, reasoning, content, calls), reasoning split by its think tags
LLAMA_CASES: list[tuple[str, str, str, list[tuple[str, dict[str, Any]]]]] = [
    ("</mm:think>Hello, world!\nWhat's up?", "", "Hello, world!\nWhat's up?", []),
    ("<mm:think>I'm\nthinking</mm:think>Hello, world!\nWhat's up?", "I'm\nthinking", "Hello, world!\nWhat's up?", []),
    ("<mm:think>Let me check the time</mm:think>" + block(invoke("get_time", el("city", "Tokyo"))),
     "Let me check the time", "",
     [("get_time", {"city": "Tokyo"})]),
    ("</mm:think>" + block(invoke("special_function", el("arg1", "1"))), "", "", [("special_function", {"arg1": 1})]),
    ("<mm:think>Let's call a tool:</mm:think>" + block(invoke("empty_args")), "Let's call a tool:", "",
     [("empty_args", {})]),
    ("<mm:think>Calling both</mm:think>" + block(invoke("get_time", el("city", "Paris")),
                                                 invoke("get_weather", el("city", "Paris"))),
     "Calling both", "", [("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris"})]),
    ("<mm:think>Thinking about it</mm:think>Let me call the function." + block(invoke("special_function",
                                                                                      el("arg1", "1"))),
     "Thinking about it", "Let me call the function.", [("special_function", {"arg1": 1})]),
    ("<mm:think>Test negative</mm:think>" + block(invoke("magic_int", el("ref", "-14"))), "Test negative", "",
     [("magic_int", {"ref": -14})]),
    ("<mm:think>Test decimal</mm:think>" + block(invoke("amount", el("orig", "3.14"))), "Test decimal", "",
     [("amount", {"orig": 3.14})]),
    ("<mm:think>Test boolean</mm:think>" + block(invoke("toggle", el("enabled", "true"))), "Test boolean", "",
     [("toggle", {"enabled": True})]),
    ("<mm:think>Multi-arg call</mm:think>" + block(invoke("magic_int", el("ref", "42"), el("name", "foo bar"))),
     "Multi-arg call", "",
     [("magic_int", {"ref": 42, "name": "foo bar"})]),
    ("<mm:think>Nested object</mm:think>" + block(invoke("imaginary_number",
                                                         el("number", el("real", "1.5") + el("imaginary", "-2.5")))),
     "Nested object", "", [("imaginary_number", {"number": {"real": 1.5, "imaginary": -2.5}})]),
    ("<mm:think>Nested arrays</mm:think>" + block(invoke("nested_args",
                                                         el("tags", el("item", "alpha") + el("item", "beta")),
                                                         el("entries",
                                                            el("item", el("id", "1") + el("label", "one"))))),
     "Nested arrays", "", [("nested_args", {"tags": ["alpha", "beta"], "entries": [{"id": 1, "label": "one"}]})]),
    ("<mm:think>Union array</mm:think>" + block(invoke("union_args",
                                                       el("filter", el("item", "alpha") + el("item", "beta")))),
     "Union array", "", [("union_args", {"filter": ["alpha", "beta"]})]),
    ("<mm:think>Union scalar</mm:think>" + block(invoke("union_args", el("limit", "5"))), "Union scalar", "",
     [("union_args", {"limit": 5})]),
    ("<mm:think>Union nested</mm:think>" + block(invoke("union_args", el("limit", el("max", "10")))), "Union nested",
     "",
     [("union_args", {"limit": {"max": 10}})]),
    ("<mm:think>Union string</mm:think>" + block(invoke("union_args", el("label", "hi"))), "Union string", "",
     [("union_args", {"label": "hi"})]),
    # a union with a string alternative is a string, even when the value looks structured
    ("<mm:think>Union string</mm:think>" + block(invoke("union_args", el("label", el("text", "hi")))), "Union string",
     "",
     [("union_args", {"label": el("text", "hi")})]),
    ("<mm:think></mm:think>" + block(invoke("get_time", el("city", "XYZCITY"))), "", "",
     [("get_time", {"city": "XYZCITY"})]),
    # ours: the object form of a union of an array and an object; a union's object form of a member
    ("</mm:think>" + block(invoke("union_args", el("filter", el("field", "a") + el("op", "eq")))), "", "",
     [("union_args", {"filter": {"field": "a", "op": "eq"}})]),
]


def ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _read(pieces: list[str]) -> tuple[str, str, list[tuple[str, Any]]]:
    p = ReplyParser(
        FORMATS["minimax_m3"], parse_tools=True, reasoning=True, tools=TOOLS, new_id=ids(), think_tags=THINK
    )
    deltas = [p.feed(x) for x in pieces] + [p.finish()]
    calls = [(c.name, json.loads(c.arguments)) for d in deltas for c in d.tool_calls]
    return "".join(d.content for d in deltas), "".join(d.reasoning for d in deltas), calls


@pytest.mark.parametrize("case", LLAMA_CASES, ids=[str(i) for i in range(len(LLAMA_CASES))])
def test_llama_cpps_minimax_m3_replies_parse_whole_and_split_anywhere(case: Any) -> None:
    text, reasoning, content, calls = case
    r = parse_reply(
        text, FORMATS["minimax_m3"], parse_tools=True, reasoning=True, tools=TOOLS, new_id=ids(), think_tags=THINK
    )
    assert (r.content, r.reasoning, [(c.name, json.loads(c.arguments)) for c in r.tool_calls]) == (
        content,
        reasoning,
        calls,
    )
    for k in range(len(text) + 1):
        assert _read([text[:k], text[k:]]) == (content, reasoning, calls), k


def test_a_cut_block_keeps_its_whole_invokes() -> None:
    text = block(invoke("get_time", el("city", "Paris")), invoke("get_weather", el("city", "Paris")))
    cut = text[: text.index("get_weather") + 20]
    p = ReplyParser(FORMATS["minimax_m3"], parse_tools=True, reasoning=False, tools=TOOLS, new_id=ids())
    deltas = [p.feed(cut), p.finish(cut=True)]
    assert "".join(d.content for d in deltas) == ""
    assert [(c.name, json.loads(c.arguments)) for d in deltas for c in d.tool_calls] == [
        ("get_time", {"city": "Paris"})
    ]


TEMPLATE_HEAD = (  # MiniMax-M3.jinja's tokens and its tools' example, as the template spells them
    "{%- set ns_token = ']<]minimax[>[' -%}{%- set toolcall_begin_token = ns_token ~ '<tool_call>' -%}"
    "{%- set think_begin_token = '<mm:think>' -%}{%- set think_end_token = '</mm:think>' -%}"
    "{{- ns_token + '<invoke name=\"tool-name-1\">' }}{{- ns_token + '<param-1>value-1' + ns_token + '</param-1>' }}"
)


def test_auto_picks_minimax_m3_before_hermes() -> None:
    assert detect_format(TEMPLATE_HEAD) is FORMATS["minimax_m3"]
    # its <tool_call> is Hermes' mark
    assert detect_format(TEMPLATE_HEAD.replace("]<]minimax[>[", "")) is FORMATS["hermes"]
    order = [fmt.name for _, fmt in detection_order()]
    assert order.index("minimax_m3") < order.index("hermes")
    caps = template_caps(ChatTemplate(name="t", source="inline", jinja=TEMPLATE_HEAD))
    assert caps.tool_format is FORMATS["minimax_m3"] and caps.think_tags == THINK
    assert detect_think_tags(TEMPLATE_HEAD) == THINK


def _accepts(grammar: Any, text: str) -> bool:
    """Whether ``grammar`` takes ``text`` whole and may end there (a vocabulary of bytes)."""
    cache = GuidanceCache([bytes([b]) for b in range(256)] + [b""], frozenset({256}), None)
    state = cache.new_state(grammar)
    return state.feed(text.encode()) and bool(state.allowed()[256])


def test_the_grammar_writes_what_the_template_prints() -> None:
    """A forced call of each of llama.cpp's tools, as the template prints it (nested objects and
    arrays expanded), is what the grammar allows; the parser reads it back."""
    req = parse_tools({"tools": [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}}
                                 for t in TOOLS.tools], "tool_choice": "required", "parallel_tool_calls": True})
    grammar = tools_grammar(req, FORMATS["minimax_m3"])
    for text, _, _, calls in LLAMA_CASES:
        reply = text[text.index(NS):] if NS in text else None
        if reply is None or "<text>" in reply or "<field>" in reply:  # (ours: the optional order of a union's object)
            continue
        assert _accepts(grammar, reply), reply
        assert [
            (c.name, json.loads(c.arguments))
            for c in parse_reply(reply, FORMATS["minimax_m3"], parse_tools=True, reasoning=False, tools=req).tool_calls
        ] == calls
    assert not _accepts(grammar, block(invoke("get_time", el("city", "a]b"))))  # a string's text holds no "]"
    assert not _accepts(grammar, block(invoke("magic_int", el("name", "x"))))  # ref is required
    lazy = tools_grammar(parse_tools({"tools": [{"type": "function", "function": {"name": "get_time", "parameters":
                                                 TOOLS.tools[0].parameters}}]}), FORMATS["minimax_m3"])
    assert lazy.triggers and "minimax" in lazy.triggers[0]
