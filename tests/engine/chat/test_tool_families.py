"""The model families whose calls are not one JSON object (engine/chat/families/) and
gpt-oss's harmony channels (families/harmony.py): each family's replies, as llama.cpp's tests expect
them parsed (restated in our words), give the same calls, reasoning and content whole and
streamed split at every point; ``auto`` picks the family from a template's markers. Pure."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import family_examples
from helpers import chat_plan
from hydra_trio.engine.chat import (
    ChatTemplate,
    ReplyParser,
    parse_reply,
    parse_tools,
    template_caps,
)
from hydra_trio.engine.chat.caps import detect_format, detect_think_tags
from hydra_trio.engine.chat.formats import FORMATS, ToolFormat

INT = {"type": "integer"}
TOOLS = parse_tools({
    "tools": [
        {"type": "function",
         "function": {"name": "special_function", "parameters": {"type": "object", "properties": {"arg1": INT}}}},
        {"type": "function", "function": {"name": "special_function_with_opt",
                                          "parameters": {"type": "object", "properties": {"arg1": INT, "arg2": INT}}}},
        {"type": "function",
         "function": {"name": "get_time",
                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "empty_args", "parameters": {"type": "object", "properties": {}}}},
        *({"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": p}}} for n, p in (
            ("toggle", {"enabled": {"type": "boolean"}}), ("set_nullable", {"value": {"type": "null"}}),
            ("set_config", {"config": {"type": "object"}}), ("python", {"code": {"type": "string"}}),
            ("html", {"markup": {"type": "string"}}),
            ("Calendar_create_event",
             {"title": {"type": "string"}, "participants": {"type": "array"}, "metadata": {"type": "object"}}),
        )),
    ],
    "parallel_tool_calls": True,
})
ONE = [("special_function", {"arg1": 1})]
TWO = [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


ATEM_CALL = ('<atem:function_calls>\n<atem:invoke name="special_function">\n'
             '<atem:parameter name="arg1">1</atem:parameter>\n'
             "</atem:invoke>\n</atem:function_calls>")
HY3_ONE = ("<tool_calls:opensource>\n<tool_call:opensource>special_function<tool_sep:opensource>\n"
           "<arg_key:opensource>arg1"
           "</arg_key:opensource>\n<arg_value:opensource>1</arg_value:opensource>\n</tool_call:opensource>\n</tool_calls:opensource>")

# (format, reply, starts in reasoning, content, reasoning, calls)
Case = tuple[str, str, bool, str, str, list[tuple[str, dict[str, Any]]]]
CASES: list[Case] = [
    # Qwen3-Coder (and Qwen3.5, Nemotron 3, StepFun 3.5): XML parameters, typed by the schema.
    ("qwen3_coder",
     "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>",
     False, "", "", ONE),
    ("qwen3_coder",
     "Let me call it.\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>",
     False, "Let me call it.", "", ONE),  # the opening <tool_call> skipped, as some models do
    ("qwen3_coder",
     "<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
     "<function=special_function_with_opt>\n<parameter=arg1>\n1\n</parameter>\n<parameter=arg2>\n2\n</parameter>\n</function>\n"
     "</tool_call>", False, "", "", TWO),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=city>\n42\n</parameter>\n</function>\n</tool_call>",
     False, "", "", [("get_time", {"city": "42"})]),  # a string parameter stays text
    ("qwen3_coder", "<think>\nplan\n</think>\n\nHello, world!", False, "Hello, world!", "plan", []),
    ("qwen3_coder", "<tool_call>\n<function=nope>\n</function>\n</tool_call>", False,
     "<tool_call>\n<function=nope>\n</function>\n</tool_call>", "", []),  # an undeclared tool: content
    ("seed_oss", "<seed:tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n"
     "</seed:tool_call>", False, "", "", ONE),
    # GLM-4.6 (newlines) and GLM-4.7 (none); its prompt may end inside <think>.
    ("glm", "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", False, "",
     "", ONE),
    ("glm",
     "I'm\nthinking</think><tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value></tool_call>",
     True, "", "I'm\nthinking", ONE),
    ("glm", "<tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value></tool_call><tool_call>"
     "special_function_with_opt<arg_key>arg1</arg_key><arg_value>1</arg_value><arg_key>arg2</arg_key><arg_value>2</arg_value>"
     "</tool_call>", False, "", "", TWO),
    ("glm", "Let me read it.</think><tool_call>empty_args</tool_call>", True, "", "Let me read it.",
     [("empty_args", {})]),
    ("glm", "I'm\nthinking</think>Hello, world!\nWhat's up?", True, "Hello, world!\nWhat's up?", "I'm\nthinking", []),
    # Kimi K2: the id is the model's own functions.NAME:IDX.
    ("kimi_k2",
     "<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0<|tool_call_argument_begin|>"
     '{"arg1": 1}<|tool_call_end|><|tool_calls_section_end|>', False, "", "", ONE),
    ("kimi_k2", "<think>I'm thinking about this</think>Hello<|tool_calls_section_begin|><|tool_call_begin|>"
     'functions.special_function:0<|tool_call_argument_begin|>{"arg1": 1}<|tool_call_end|><|tool_call_begin|>'
     'functions.special_function_with_opt:1<|tool_call_argument_begin|>{"arg1": 1, "arg2": 2}<|tool_call_end|>'
     "<|tool_calls_section_end|>", False, "Hello", "I'm thinking about this", TWO),
    # DeepSeek V3.1 (NAME<sep>JSON) and R1 (function<sep>NAME ```json```), prompt ending in <think>.
    ("deepseek",
     '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "XYZCITY"}<｜tool▁call▁end｜>'
     "<｜tool▁calls▁end｜>", False, "", "", [("get_time", {"city": "XYZCITY"})]),
    ("deepseek",
     'REASONING</think>CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "Paris"}'
     '<｜tool▁call▁end｜><｜tool▁call▁begin｜>special_function<｜tool▁sep｜>{"arg1": '
     '1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     True, "CONTENT", "REASONING", [("get_time", {"city": "Paris"}), ("special_function", {"arg1": 1})]),
    ("deepseek", "</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n```json\n"
     '{"arg1": 1}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', True, "", "", ONE),
    # DeepSeek V3.2 (function_calls) and V4 (tool_calls) DSML; string="false" is JSON.
    ("deepseek_dsml",
     '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_time">\n<｜DSML｜parameter name="city" string="true">'
     "Tokyo</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>", False, "", "",
     [("get_time", {"city": "Tokyo"})]),
    ("deepseek_dsml", '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="special_function">\n<｜DSML｜parameter name="arg1" '
     'string="false">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>', False, "", "", ONE),
    # MiniMax M2: its prompt ends inside <think>.
    ("minimax",
     'Let\'s call a tool:\n</think>\n\n<minimax:tool_call>\n<invoke name="empty_args">\n</invoke>\n'
     '</minimax:tool_call>',
     True, "", "Let's call a tool:", [("empty_args", {})]),
    ("minimax",
     '\n</think>\n\n<minimax:tool_call>\n<invoke name="special_function">\n<parameter name="arg1">1</parameter>\n'
     "</invoke>\n</minimax:tool_call>", True, "", "", ONE),
    # Gemma 4: bare keys, strings between <|"|>; its reasoning is the "thought" channel.
    ("gemma4", '<|tool_call>call:get_time{city:<|"|>San Francisco<|"|>}<tool_call|>', False, "", "",
     [("get_time", {"city": "San Francisco"})]),
    ("gemma4", "<|tool_call>call:empty_args{}<tool_call|>", False, "", "", [("empty_args", {})]),
    ("gemma4", 'Hello, world!\nWhat\'s up?<|tool_call>call:get_time{city:<|"|>Paris<|"|>}<tool_call|>'
     "<|tool_call>call:special_function{arg1:1}<tool_call|>", False, "Hello, world!\nWhat's up?", "",
     [("get_time", {"city": "Paris"}), ("special_function", {"arg1": 1})]),
    # Nemotron Nano v2 (its prompt may end inside <think>), Apriel 1.5/1.6, Granite 3.3: a JSON list of calls.
    ("nemotron",
     'I\'m\nthinking\n</think>\n<TOOLCALL>[{"name": "special_function", "arguments": {"arg1": 1}}]</TOOLCALL>',
     True, "", "I'm\nthinking", ONE),
    ("nemotron",
     '<TOOLCALL>[{"name": "special_function", "arguments": {"arg1": 1}}, {"name": "special_function_with_opt", '
     '"arguments": {"arg1": 1, "arg2": 2}}]</TOOLCALL>\n', False, "", "", TWO),
    ("apriel", '<tool_calls>[{"name": "special_function", "arguments": {"arg1": 1}}]</tool_calls>', False, "", "", ONE),
    ("apriel", 'Sure.\n<tool_calls>[{"name": "get_time", "arguments": {"city": "Paris"}, "id": "abc"}]</tool_calls>',
     False,
     "Sure.", "", [("get_time", {"city": "Paris"})]),
    ("granite", '<|tool_call|>[{"name": "special_function", "arguments": {"arg1": 1}}]', False, "", "", ONE),
    # Cohere Command R7B (a reply may open with its thinking) and Cohere2MoE (its prompt opens it).
    ("cohere", "<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_ACTION|>[\n    {\"tool_call_id\": \"0\", "
     '"tool_name": "special_function", "parameters": {"arg1": 1}}\n]<|END_ACTION|>', False, "", "I'm\nthinking", ONE),
    ("cohere", "<|END_THINKING|><|START_ACTION|>[\n    {\"tool_call_id\": \"0\", \"tool_name\": \"special_function\", "
     '"parameters": {"arg1": 1}},\n    {"tool_call_id": "1", "tool_name": "special_function_with_opt", "parameters": '
     '{"arg1": 1, "arg2": 2}}\n]<|END_ACTION|>', True, "", "", TWO),
    # LFM2 and LFM2.5: Python-style calls (Python's literals become JSON's; JSON's are taken too).
    ("lfm2", "Hello, world!\nWhat's up?", False, "Hello, world!\nWhat's up?", "", []),
    ("lfm2", "<|tool_call_start|>[special_function(arg1=1)]<|tool_call_end|>", False, "", "", ONE),
    ("lfm2", '<|tool_call_start|>[get_time(city="XYZCITY")]<|tool_call_end|>', False, "", "",
     [("get_time", {"city": "XYZCITY"})]),
    ("lfm2", "<|tool_call_start|>[get_time(city='Paris')]<|tool_call_end|>", False, "", "",
     [("get_time", {"city": "Paris"})]),
    ("lfm2", "<|tool_call_start|>[toggle(enabled=True)]<|tool_call_end|>", False, "", "",
     [("toggle", {"enabled": True})]),
    ("lfm2", "<|tool_call_start|>[set_nullable(value=None)]<|tool_call_end|>", False, "", "",
     [("set_nullable", {"value": None})]),
    ("lfm2", '<|tool_call_start|>[set_config(config={"enabled": True, "count": 3})]<|tool_call_end|>', False, "", "",
     [("set_config", {"config": {"enabled": True, "count": 3}})]),
    ("lfm2", '<|tool_call_start|>[set_config(config={"enabled": true, "note": null})]<|tool_call_end|>', False, "", "",
     [("set_config", {"config": {"enabled": True, "note": None}})]),
    # (llama.cpp names this tool Calendar.create_event: our tool names are OpenAI's, no dots)
    ("lfm2", '<|tool_call_start|>[Calendar_create_event(title="demo", participants=["Alice", "Bob"], '
     'metadata={"priority": "high", "reminder": true})]<|tool_call_end|>', False, "", "",
     [("Calendar_create_event",
       {"title": "demo", "participants": ["Alice", "Bob"], "metadata": {"priority": "high", "reminder": True}})]),
    ("lfm2", "Use this format: [link text](url). Example: [Wikipedia](https://www.wikipedia.org).", False,
     "Use this format: [link text](url). Example: [Wikipedia](https://www.wikipedia.org).", "", []),
    ("lfm2", '<|tool_call_start|>[python(code="def hello():\\n    print(\'hey\')")]<|tool_call_end|>', False, "", "",
     [("python", {"code": "def hello():\n    print('hey')"})]),  # an escape is its character
    ("lfm2", '<|tool_call_start|>[python(code="First line\\nSecond line\\tindented")]<|tool_call_end|>', False, "", "",
     [("python", {"code": "First line\nSecond line\tindented"})]),
    ("lfm2", '<|tool_call_start|>[python(code="print(\\"hi\\")")]<|tool_call_end|>', False, "", "",
     [("python", {"code": 'print("hi")'})]),
    ("lfm2", 'Let me check the time.<|tool_call_start|>[get_time(city="Paris")]<|tool_call_end|>', False,
     "Let me check the time.", "", [("get_time", {"city": "Paris"})]),
    ("lfm2",
     "<|tool_call_start|>[special_function(arg1=1), special_function_with_opt(arg1=1, arg2=2)]<|tool_call_end|>",
     False, "", "", TWO),
    ("lfm2", "<|tool_call_start|>[empty_args()]<|tool_call_end|>", False, "", "", [("empty_args", {})]),
    ("lfm2", "<|tool_call_start|>[special_function(arg1=", False, "<|tool_call_start|>[special_function(arg1=", "", []),
    # LFM2.5-8B-A1B thinks: a call's marker inside the reasoning is reasoning.
    ("lfm2", "<think>I'm\nthinking</think><|tool_call_start|>[special_function(arg1=1)]<|tool_call_end|>", False, "",
     "I'm\nthinking", ONE),
    ("lfm2", '<think>I need to call a function</think>Let me check the time.<|tool_call_start|>[get_time(city="Paris")]'
     "<|tool_call_end|>", False, "Let me check the time.", "I need to call a function",
     [("get_time", {"city": "Paris"})]),
    ("lfm2", "<think>Let me think about <|tool_call_start|>[special_function(arg1=1)]<|tool_call_end|> hmm</think>"
     "<|tool_call_start|>[special_function(arg1=1)]<|tool_call_end|>", False, "",
     "Let me think about <|tool_call_start|>[special_function(arg1=1)]<|tool_call_end|> hmm", ONE),
    ("lfm2", "<|tool_call_start|>[nope(a=1)]<|tool_call_end|>", False,
     "<|tool_call_start|>[nope(a=1)]<|tool_call_end|>",
     "", []),  # an undeclared tool: content
    # firefunction v2: a JSON list after "functools" (no closing marker).
    ("firefunction", 'Hello, world!\nWhat\'s up?', False, "Hello, world!\nWhat's up?", "", []),
    ("firefunction", ' functools[{"name": "special_function", "arguments": {"arg1": 1}}]', False, "", "", ONE),
    ("firefunction", 'Sure. functools[{"name": "special_function", "arguments": {"arg1": 1}}, {"name": '
     '"special_function_with_opt", "arguments": {"arg1": 1, "arg2": 2}}]', False, "Sure.", "", TWO),
    ("firefunction", "I used functools.partial here.", False, "I used functools.partial here.", "", []),
    # MiniMax M1: one call's JSON a line between <tool_calls> tags (its template's own example; arguments
    # it prints | tojson, so a string of JSON, are taken too).
    ("minimax_m1", 'Sure.\n<tool_calls>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_calls>', False,
     "Sure.", "", ONE),
    ("minimax_m1",
     '<tool_calls>\n{"name": "special_function", "arguments": {"arg1": 1}}\n{"name": "special_function_with_opt", '
     '"arguments": {"arg1": 1, "arg2": 2}}\n</tool_calls>', False, "", "", TWO),
    ("minimax_m1", '<tool_calls>\n{"name": "special_function", "arguments": "{\\"arg1\\": 1}"}\n</tool_calls>', False,
     "", "", ONE),
    ("minimax_m1", "<tool_calls>\nnot a call\n</tool_calls>", False, "<tool_calls>\nnot a call\n</tool_calls>", "", []),
    # Apertus: the tool's name is the key of its arguments; <|inner_prefix|>...<|inner_suffix|> its deliberation.
    ("apertus", '<|tools_prefix|>[{"special_function": {"arg1": 1}}]<|tools_suffix|>', False, "", "", ONE),
    ("apertus",
     '<|inner_prefix|>I\'m\nthinking<|inner_suffix|>Sure.<|tools_prefix|>[{"special_function": {"arg1": 1}}, '
     '{"special_function_with_opt": {"arg1": 1, "arg2": 2}}]<|tools_suffix|>', False, "Sure.", "I'm\nthinking", TWO),
    ("apertus", '<|tools_prefix|>[{"special_function": "{\\"arg1\\": 1}"}]<|tools_suffix|>', False, "", "", ONE),
    ("apertus", '<|tools_prefix|>[{"special_function": {"arg1": 1}, "x": 2}]<|tools_suffix|>', False,
     '<|tools_prefix|>[{"special_function": {"arg1": 1}, "x": 2}]<|tools_suffix|>', "", []),  # not one name: content
    # GigaChat3: the call is a "function call" role's message; GigaChat3.1: after <|function_call|>.
    ("gigachat3", "Hello, world!\nWhat's up?", False, "Hello, world!\nWhat's up?", "", []),
    ("gigachat3",
     '<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "special_function", "arguments": {"arg1": 1}}', False,
     "", "", ONE),
    ("gigachat3",
     'Hello, world!\nWhat\'s up?<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "special_function", '
     '"arguments": {"arg1": 1}}', False, "Hello, world!\nWhat's up?", "", ONE),
    ("gigachat3_1", '<|function_call|>{"name": "special_function", "arguments": {"arg1": 1}}', False, "", "", ONE),
    ("gigachat3_1", 'Hello, world!\nWhat\'s up?<|function_call|>{"name": "special_function", "arguments": {"arg1": 1}}',
     False,
     "Hello, world!\nWhat's up?", "", ONE),
    # MiniCPM5: XML parameters (a string's text as written, a CDATA block's as is); its prompt may open <think>.
    ("minicpm5", "Hello, world!\nWhat's up?", False, "Hello, world!\nWhat's up?", "", []),
    ("minicpm5", '<function name="python"><param name="code">print(\'Hello, World!\')</param></function>', False, "",
     "",
     [("python", {"code": "print('Hello, World!')"})]),
    ("minicpm5", '<function name="empty_args"></function>', False, "", "", [("empty_args", {})]),
    ("minicpm5",
     '<function name="html"><param name="markup"><![CDATA[<a href="/x">hi</a> </param>]]></param></function>', False,
     "", "", [("html", {"markup": '<a href="/x">hi</a> </param>'})]),
    ("minicpm5", 'I\'m thinking</think><function name="python"><param name="code">print(\'hey\')</param></function>',
     True,
     "", "I'm thinking", [("python", {"code": "print('hey')"})]),
    ("minicpm5", '<function name="python"><param name="code">print(\'x\')</param></function>\n<function name="python">'
     '<param name="code">print(\'y\')</param></function>', False, "", "",
     [("python", {"code": "print('x')"}), ("python", {"code": "print('y')"})]),
    ("minicpm5", '<function name="special_function_with_opt"><param name="arg1">1</param>\n<param name="arg2">2</param>'
     "</function>", False, "", "", [("special_function_with_opt", {"arg1": 1, "arg2": 2})]),  # typed by the schema
    # functionary v3.2: the prompt ends with ">>>"; a message's recipient line, "all" for content.
    ("functionary", "all\nHello, world!\nWhat's up?", False, "Hello, world!\nWhat's up?", "", []),
    ("functionary", 'special_function\n{"arg1": 1}', False, "", "", ONE),
    ("functionary",
     'all\nLet me check.>>>special_function\n{"arg1": 1}>>>special_function_with_opt\n{"arg1": 1, "arg2": 2}',
     False, "Let me check.", "", TWO),
    ("functionary", 'special_function\n{"arg1": 1}\n>>>all\nDone.', False, "Done.", "", ONE),
    ("functionary", "Hello there, no recipient", False, "Hello there, no recipient", "", []),
    ("functionary", 'nope\n{"a": 1}', False, 'nope\n{"a": 1}', "", []),  # an undeclared tool: content
    # Upstage Solar Open: the model's id, the name, the JSON arguments (its template's own form).
    ("solar", '<|tool_calls|><|tool_call:begin|>abc123<|tool_call:name|>special_function<|tool_call:args|>{"arg1": 1}'
     "<|tool_call:end|>", False, "", "", ONE),
    ("solar",
     '<|tool_calls|><|tool_call:begin|>a<|tool_call:name|>special_function<|tool_call:args|>{"arg1": '
     '1}<|tool_call:end|>'
     '<|tool_call:begin|>b<|tool_call:name|>special_function_with_opt<|tool_call:args|>{"arg1": 1, "arg2": 2}'
     "<|tool_call:end|>", False, "", "", TWO),
    ("solar",
     "<|tool_calls|><|tool_call:begin|>a<|tool_call:name|>special_function<|tool_call:args|>nope<|tool_call:end|>",
     False,
     "<|tool_calls|><|tool_call:begin|>a<|tool_call:name|>special_function<|tool_call:args|>nope<|tool_call:end|>", "",
     []),
    # Kimi K3: XTML tags; its prompt opens the think (or response) section; response and message tags dropped.
    ("kimi_k3", "<|open|>response<|sep|>Hello, world!\nWhat's up?<|close|>response<|sep|><|close|>message<|sep|>",
     False,
     "Hello, world!\nWhat's up?", "", []),
    ("kimi_k3", "I'm thinking about this<|close|>think<|sep|><|open|>response<|sep|>Hello, world!\nWhat's up?"
     "<|close|>response<|sep|><|close|>message<|sep|>", True, "Hello, world!\nWhat's up?", "I'm thinking about this",
     []),
    ("kimi_k3", "<|open|>response<|sep|>Use the response tag, then message the handler.<|close|>response<|sep|>"
     "<|close|>message<|sep|>", False, "Use the response tag, then message the handler.", "", []),
    ("kimi_k3", "I was still thinking when the budget ran out", True, "",
     "I was still thinking when the budget ran out", []),
    ("kimi_k3",
     '<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="special_function" '
     'index="1"<|sep|><|open|>argument key="arg1" type="number"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|>'
     "<|close|>tools<|sep|><|close|>message<|sep|>", False, "", "", ONE),
    ("kimi_k3",
     'I should call it<|close|>think<|sep|><|open|>response<|sep|>On it.<|close|>response<|sep|><|open|>tools<|sep|>'
     '<|open|>call tool="special_function" index="1"<|sep|><|open|>argument key="arg1" type="number"<|sep|>1'
     "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>", True, "On it.",
     "I should call it", ONE),
    ("kimi_k3",
     '<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="special_function" '
     'index="1"<|sep|><|open|>argument key="arg1" type="number"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|>'
     '<|open|>call tool="special_function_with_opt" index="2"<|sep|><|open|>argument key="arg1" type="number"<|sep|>1'
     '<|close|>argument<|sep|><|open|>argument key="arg2" type="number"<|sep|>2<|close|>argument<|sep|><|close|>'
     'call<|sep|>'
     "<|close|>tools<|sep|><|close|>message<|sep|>", False, "", "", TWO),
    ("kimi_k3",
     '<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="python" index="1"<|sep|>'
     '<|open|>argument key="code" type="string"<|sep|>print(\'hey\')<|close|>argument<|sep|><|close|>call<|sep|>'
     "<|close|>tools<|sep|><|close|>message<|sep|>", False, "", "", [("python", {"code": "print('hey')"})]),
    ("kimi_k3",
     '<|open|>tools<|sep|><|open|>call tool="special_function" index="1"<|sep|><|open|>json type="object"<|sep|>'
     # arguments as one JSON
     '{"arg1": 1}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>', False, "", "", ONE),
    # Cohere's content wrappers (R7B's response, Cohere2MoE's text) are not content.
    ("cohere", "<|START_RESPONSE|>Hello, world!\nWhat's up?<|END_RESPONSE|>", False, "Hello, world!\nWhat's up?", "",
     []),
    ("cohere",
     "<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_RESPONSE|>Hello, world!\nWhat's up?<|END_RESPONSE|>",
     False, "Hello, world!\nWhat's up?", "I'm\nthinking", []),
    ("cohere", "I'm\nthinking<|END_THINKING|><|START_TEXT|>Hello, world!\nWhat's up?<|END_TEXT|>", True,
     "Hello, world!\nWhat's up?", "I'm\nthinking", []),
    # Cohere Command R+: "Action:" and a JSON code block; its turn tokens are not content.
    ("command_r_plus", "<|CHATBOT_TOKEN|>Hello, world!\nWhat's up?<|END_OF_TURN_TOKEN|>", False,
     "Hello, world!\nWhat's up?", "", []),
    ("command_r_plus", 'Action:\n```json\n[{"tool_name": "special_function", "parameters": {"arg1": 1}}]\n```', False,
     "", "", ONE),
    ("command_r_plus",
     'Action:\n```json\n[\n    {"tool_name": "special_function", "parameters": {"arg1": 1}},\n    {"tool_name": '
     '"special_function_with_opt", "parameters": {"arg1": 1, "arg2": 2}}\n]\n```', False, "", "", TWO),
    # gpt-oss harmony: analysis is reasoning, final (and commentary to no one) content, to=functions.NAME a call.
    ("harmony", "<|channel|>final<|message|>Hello, world!\nWhat's up?", False, "Hello, world!\nWhat's up?", "", []),
    ("harmony", "<|channel|>commentary<|message|>Hello, world!", False, "Hello, world!", "", []),
    ("harmony",
     "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>Hello, world!",
     False, "Hello, world!", "I'm\nthinking", []),
    ("harmony", "<|channel|>analysis<|message|>I'm\nthinking", False, "", "I'm\nthinking", []),
    ("harmony", ' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', False, "", "", ONE),
    ("harmony", '<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', False, "", "", ONE),
    ("harmony", ' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}', False, "",
     "", ONE),
    ("harmony", "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.special_function <|constrain|>json<|message|>{"arg1": 1}<|call|>', False, "", "I'm\nthinking", ONE),
    ("harmony", "<|channel|>analysis<|message|>run python<|end|><|start|>assistant<|channel|>commentary to=python "
     "<|constrain|>code<|message|>print(\"hello\")", False, "", "run python", []),  # a built-in tool's message: dropped
    ("harmony", "Plain text, no channels.", False, "Plain text, no channels.", "", []),
    # Muse Glimmer (the prompt ends with <|start|>assistant): to=self is reasoning, to=user the answer, a
    # message to a tool its call; a message's end is <|eom|> (more follow) or <|eot|>.
    ("muse_glimmer", " to=user<|message|>Hello, world!\nWhat's up?<|eot|>", False, "Hello, world!\nWhat's up?", "", []),
    ("muse_glimmer", " to=special_function<|message|>" + ATEM_CALL, False, "", "", ONE),  # a call right away
    ("muse_glimmer",
     " to=user<|message|>Hello, world!\nWhat's up?<|eom|><|start|>assistant to=special_function<|message|>"
     + ATEM_CALL, False, "Hello, world!\nWhat's up?", "", ONE),  # an answer, then a call in the same reply
    ("muse_glimmer", " to=user<|message|>You invoke it like this:\n" + ATEM_CALL + "<|eot|>", False,
     "You invoke it like this:\n" + ATEM_CALL, "", []),  # markup quoted in the answer is no call
    ("muse_glimmer", " to=self<|message|>I need to output JSON<|eom|><|start|>assistant to=user<|message|>{\"a\": 1}",
     False,
     '{"a": 1}', "I need to output JSON", []),
    ("muse_glimmer",
     " to=self<|message|>I could use " + ATEM_CALL + " here<|eom|><|start|>assistant to=user<|message|>Hello!<|eot|>",
     False, "Hello!", "I could use " + ATEM_CALL + " here", []),  # markup in the reasoning is reasoning
    ("muse_glimmer",
     " to=self<|message|>I'm\nthinking<|eom|><|start|>assistant to=special_function<|message|>" + ATEM_CALL
     + "<|eom|><|start|>assistant "
     "to=special_function_with_opt<|message|>" + ATEM_CALL.replace('special_function">', 'special_'
     'function_with_opt">').replace("1</atem:parameter>\n",
                                    '1</atem:parameter>\n<atem:parameter name="arg2">2</atem:parameter>\n'),
     False, "", "I'm\nthinking", TWO),
    ("muse_glimmer",
     ' to=get_time<|message|><atem:function_calls>\n<atem:invoke name="get_time">\n<atem:parameter name="city">'
     " 42\n</atem:parameter>\n</atem:invoke>\n</atem:function_calls>", False, "", "",
     [("get_time", {"city": " 42\n"})]),
    ("muse_glimmer",
     ' to=nope<|message|><atem:function_calls>\n<atem:invoke name="nope">\n</atem:invoke>\n</atem:function_calls>',
     # undeclared
     False, '<atem:function_calls>\n<atem:invoke name="nope">\n</atem:invoke>\n</atem:function_calls>', "", []),
    ("muse_glimmer", "Plain text, no messages.", False, "Plain text, no messages.", "", []),
    # Tencent Hy3 (llama.cpp reads it with its autoparser, with no parse test: as its template prints calls).
    ("hy3", HY3_ONE, False, "", "", ONE),
    ("hy3",
     HY3_ONE.replace("</tool_call:opensource>\n",
                     "</tool_call:opensource>\n<tool_call:opensource>special_function_with_opt"
     "<tool_sep:opensource>\n<arg_key:opensource>arg1</arg_key:opensource>\n<arg_value:opensource>1</arg_value:opensource>\n"
     "<arg_key:opensource>arg2</arg_key:opensource>\n<arg_value:opensource>2</arg_value:opensource>\n</tool_call:opensource>\n"),
     False, "", "", TWO),
    ("hy3", "I'm\nthinking</think:opensource>Let me check.\n" + HY3_ONE, True, "Let me check.", "I'm\nthinking", ONE),
    ("hy3", "<think:opensource></think:opensource>Hello, world!", False, "Hello, world!", "", []),
    ("hy3", "<tool_calls:opensource>\n<tool_call:opensource>get_time<tool_sep:opensource>\n<arg_key:opensource>city"
     "</arg_key:opensource>\n<arg_value:opensource>42</arg_value:opensource>\n</tool_call:opensource>\n</tool_calls:opensource>",
     False, "", "", [("get_time", {"city": "42"})]),  # a string parameter stays text
    ("hy3", "<tool_call:opensource>nope<tool_sep:opensource>\n</tool_call:opensource>", False,
     "<tool_call:opensource>nope<tool_sep:opensource>\n</tool_call:opensource>", "", []),  # an undeclared tool: content
    *family_examples.CASES,  # the families added since, from their own test modules
]


# A family's think markers where they are not <think> (caps.detect_think_tags reads them from its template).
THINK_TAGS = {
    "hy3": ("<think:opensource>", "</think:opensource>"),
    "kimi_k3": ("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
    "cohere": ("<|START_THINKING|>", "<|END_THINKING|>"),
    "apertus": ("<|inner_prefix|>", "<|inner_suffix|>"),
}


def _whole(fmt: ToolFormat, text: str, starts_in: bool) -> tuple[str, str, list[Any]]:
    r = parse_reply(
        text,
        fmt,
        parse_tools=True,
        reasoning=True,
        starts_in_reasoning=starts_in,
        tools=TOOLS,
        new_id=ids(),
        **_tags(fmt),
    )
    return r.content, r.reasoning, r.tool_calls


def _streamed(fmt: ToolFormat, pieces: list[str], starts_in: bool) -> tuple[str, str, list[Any]]:
    p = ReplyParser(
        fmt, parse_tools=True, reasoning=True, starts_in_reasoning=starts_in, tools=TOOLS, new_id=ids(), **_tags(fmt)
    )
    deltas = [p.feed(x) for x in pieces] + [p.finish()]
    assert [c for d in deltas for c in d.tool_calls] == p.calls
    return "".join(d.content for d in deltas), "".join(d.reasoning for d in deltas), p.calls


def _tags(fmt: ToolFormat) -> dict[str, Any]:
    return {"think_tags": THINK_TAGS[fmt.name]} if fmt.name in THINK_TAGS else {}


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_familys_reply_parses_whole_and_split_anywhere(case: Case) -> None:
    name, text, starts_in, content, reasoning, calls = case
    fmt = FORMATS[name]
    whole = _whole(fmt, text, starts_in)
    assert (whole[0], whole[1]) == (content, reasoning)
    assert [(c.name, json.loads(c.arguments)) for c in whole[2]] == calls
    assert [c.index for c in whole[2]] == list(range(len(calls)))
    for k in range(len(text) + 1):  # every split point in two, and character by character
        assert _streamed(fmt, [text[:k], text[k:]], starts_in) == whole, k
    assert _streamed(fmt, list(text), starts_in) == whole


def test_cohere_keeps_the_models_call_ids() -> None:
    text = next(c[1] for c in CASES if c[0] == "cohere" and "special_function_with_opt" in c[1])
    assert [c.id for c in _whole(FORMATS["cohere"], text, True)[2]] == ["0", "1"]


def test_solar_keeps_the_models_call_ids() -> None:
    text = next(c[1] for c in CASES if c[0] == "solar" and "special_function_with_opt" in c[1])
    assert [c.id for c in _whole(FORMATS["solar"], text, False)[2]] == ["a", "b"]


def test_kimi_keeps_the_models_call_ids() -> None:
    text = CASES[13][1]
    assert [c.id for c in _whole(FORMATS["kimi_k2"], text, False)[2]] == [
        "functions.special_function:0", "functions.special_function_with_opt:1"
    ]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_any_split_of_a_familys_reply_is_its_whole_parse(case: Case, data: st.DataObject) -> None:
    name, text, starts_in = case[0], case[1], case[2]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert _streamed(FORMATS[name], pieces, starts_in) == _whole(FORMATS[name], text, starts_in)


def test_content_markup_is_removed_without_tools_too() -> None:
    """functionary's ``all`` recipient line, Kimi K3's response and message tags and Cohere's are not
    content in a reply to a request without tools either (as llama.cpp's parsers read them);
    a call's text is then content."""
    for name, text, content in (
        ("functionary", "all\nHello, world!", "Hello, world!"),
        ("functionary", 'special_function\n{"arg1": 1}', 'special_function\n{"arg1": 1}'),
        ("kimi_k3", "<|open|>response<|sep|>Hello, world!<|close|>response<|sep|><|close|>message<|sep|>",
         "Hello, world!"),
        # reasoning not split: the think block stays, the response wrapper goes (llama.cpp's "unparsed" R7B case)
        ("cohere",
         "<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_RESPONSE|>Hello, world!\nWhat's up?<|END_RESPONSE|>",
         "<|START_THINKING|>I'm\nthinking<|END_THINKING|>Hello, world!\nWhat's up?"),
    ):
        fmt = FORMATS[name]
        r = parse_reply(text, fmt, parse_tools=False, reasoning=False)
        assert (r.content, r.tool_calls) == (content, []), name
        p = ReplyParser(fmt, parse_tools=False, reasoning=False)
        assert "".join(p.feed(c).content for c in text) + p.finish().content == content, name


def test_harmony_without_reasoning_shows_the_analysis_as_content() -> None:
    text = "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>Hi"
    r = parse_reply(text, FORMATS["harmony"], parse_tools=False, reasoning=False)
    assert (r.content, r.reasoning) == ("I'm\nthinkingHi", "")
    text = " to=self<|message|>I'm\nthinking<|eom|><|start|>assistant to=user<|message|>Hi<|eot|>"
    r = parse_reply(text, FORMATS["muse_glimmer"], parse_tools=False, reasoning=False)
    assert (r.content, r.reasoning) == ("I'm\nthinkingHi", "")  # Muse Glimmer's self messages the same


# ---- detection from a template's markers --------------------------------------------------------

HY3_SOURCE = ("{%- set HYTK = ':opensource' %}{%- set think_begin_token = '<think{}>'.format(HYTK) %}"
              "{%- set toolsep_token = '<tool_sep{}>'.format(HYTK) %}{%- set argkey_begin_token = "
              "'<arg_key{}>'.format(HYTK) %}")

SNIPPETS = [
    ("{{ '<tool_call>\\n<function=' + name + '>\\n<parameter=' + k + '>' }}", "qwen3_coder"),
    ("{{ '<seed:tool_call>\\n<function=' + name + '>' }}<parameter={{ k }}>", "seed_oss"),
    ("{{ '<tool_call>' + name }}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value>", "glm"),
    ("<|tool_calls_section_begin|>{% for c in calls %}<|tool_call_begin|>{% endfor %}", "kimi_k2"),
    ("{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' }}", "deepseek"),
    ("{% set dsml_token = '｜DSML｜' %}{{ '<' + dsml_token + 'invoke name=' }}", "deepseek_dsml"),
    ("<minimax:tool_call>\\n<invoke name=\"{{ name }}\">", "minimax"),
    ("{{ '<|start|>assistant<|channel|>' + channel + '<|message|>' }}", "harmony"),
    ("{{ '<|tool_call>call:' + name + '{' }}...{{ '}<tool_call|>' }}", "gemma4"),
    ("{% if tools %}<tool_call>{{ tool | tojson }}</tool_call>{% endif %}", "hermes"),
    ("respond only with <|tool_call|> followed by a JSON list of tools used", "granite"),  # Granite 3.3
    ("Action: write <|START_ACTION|> followed by a list of JSON-formatted tool calls ...]<|END_ACTION|>", "cohere"),
    ("{{- '<|im_start|>system\\n<|tool_list_start|>' + tools | tojson + '<|tool_list_end|>' -}}", "lfm2"),  # LFM2
    ("{%- set ns.system_prompt = ns.system_prompt + \"List of tools: [\" -%}", "lfm2"),  # LFM2.5
    ("{%- set ns.content = ns.content + ' functools[' + tool.calls | join(', ') + ']' -%}", "firefunction"),
    ("{{ '<beginning_of_sentence>ai name=assistant\\n<tool_calls>\\n' -}}...{{ '</tool_calls><end_of_sentence>\\n' -}}",
     "minimax_m1"),
    ("{%- set tool_calls_token = '<|tools_prefix|>' -%}{%- set end_tool_calls_token = '<|tools_suffix|>' -%}",
     "apertus"),
    ("{%- set add_tokens = namespace(role_sep=\"<|role_sep|>\\n\", message_sep=\"<|message_sep|>\\n\\n\") -%}"
     "{%- set call = {'role': 'function call'} -%}", "gigachat3"),
    ("{%- set add_tokens = namespace(role_sep=\"<|role_sep|>\\n\", function_call=\"<|function_call|>\") -%}",
     "gigachat3_1"),
    ("Tool usage guidelines:\n...<function name=\"function-name\"><param "
     "name=\"param-name\">param-value</param></function>",
     "minicpm5"),
    ("Respond in this format:\\n>>>${recipient}\\n${content}...{{ '>>>all\\n' + message['content'] }}", "functionary"),
    ("{{- \"<|tool_call:begin|>\" + tool_call.id +\"<|tool_call:name|>\" + tool_call.function.name + "
     "\"<|tool_call:args|>\" }}",
     "solar"),
    ("{{- '<|open|>' + tag -}}...{{- '<|close|>' + tag + '<|sep|>' -}}...<|end_of_msg|>", "kimi_k3"),
    (HY3_SOURCE, "hy3"),
    ("{{- '<atem:function_calls>\\n<atem:invoke name=\"' + tc.function.name + '\">\\n' -}}...{{- '<|eom|>' -}}",
     "muse_glimmer"),
    ("{{- '\\nAction:\\n```json\\n[\\n' }}...You should use the `directly-answer` tool if ...", "command_r_plus"),
    ("{{- '<TOOLCALL>[' -}}{% for c in calls %}{{ c | tojson }}{% endfor %}{{- ']</TOOLCALL>' -}}", "nemotron"),
    ("Return all function calls as a list of json objects within <tool_call></tool_call> XML tags:\n"
     "<tool_calls>[{\"name\": <function-name-1>}]</tool_calls>", "apriel"),  # Apriel 1.5 names both
]


@pytest.mark.parametrize(("source", "name"), SNIPPETS, ids=[n for _, n in SNIPPETS])
def test_auto_picks_the_family_from_the_templates_markers(source: str, name: str) -> None:
    assert detect_format(source) is FORMATS[name]
    caps = template_caps(ChatTemplate(name="t", source="inline", jinja=source))
    assert caps.tool_format is FORMATS[name] and caps.as_dict()["tool_format"] == name
    # a named parser overrides what the source suggests
    assert (
        template_caps(ChatTemplate(name="t", source="inline", jinja=source), "hermes").tool_format is FORMATS["hermes"]
    )


def test_each_familys_think_markers() -> None:
    assert detect_think_tags("{{ '<seed:think>' + r + '</seed:think>' }}") == ("<seed:think>", "</seed:think>")
    assert detect_think_tags("[THINK]{{ r }}[/THINK]") == ("[THINK]", "[/THINK]")
    assert detect_think_tags("<|START_THINKING|>{{ r }}<|END_THINKING|>") == ("<|START_THINKING|>", "<|END_THINKING|>")
    assert detect_think_tags("{%- set inner_token = '<|inner_prefix|>' "
                             "-%}{%- set outer_token = '<|inner_suffix|>' -%}") == (
        "<|inner_prefix|>", "<|inner_suffix|>")
    assert detect_think_tags("{{- '<|open|>' + tag -}}{{- '<|close|>' + tag -}}<|end_of_msg|>") == (
        "<|open|>think<|sep|>", "<|close|>think<|sep|>")  # Kimi K3 builds its tags
    assert detect_think_tags(HY3_SOURCE) == ("<think:opensource>", "</think:opensource>")  # Hy3 formats its tags
    assert detect_think_tags("<think>{{ r }}</think>") == ("<think>", "</think>")
    assert detect_think_tags("<mm:think>{{ r }}</mm:think>") == ("<mm:think>", "</mm:think>")
    assert detect_think_tags("{{ '<|channel>thought\\n' + r + '<channel|>' }}") == ("<|channel>thought", "<channel|>")
    gemma = parse_reply("<|channel>thought\nI'm\nthinking<channel|>Hello", FORMATS["gemma4"], parse_tools=False,
                        reasoning=True, think_tags=("<|channel>thought", "<channel|>"))
    assert (gemma.reasoning, gemma.content) == ("I'm\nthinking", "Hello")
    assert detect_think_tags("{{ messages }}") is None
    seed = "<seed:think>plan</seed:think>Answer"
    r = parse_reply(
        seed, FORMATS["seed_oss"], parse_tools=False, reasoning=True, think_tags=("<seed:think>", "</seed:think>")
    )
    assert (r.reasoning, r.content) == ("plan", "Answer")
    caps = template_caps(ChatTemplate(name="t", source="inline", jinja="<|channel|>analysis<|message|>"))
    assert caps.thinks  # harmony's analysis channel is its reasoning
    glimmer = template_caps(ChatTemplate(name="t", source="inline", jinja="<atem:function_calls>{{ x }}<|eom|>"))
    assert glimmer.thinks and glimmer.tool_format is FORMATS["muse_glimmer"]  # and Muse Glimmer's to=self messages


# ---- calls after a prompt that opens a think block ----------------------------------------

DEEPSEEK_LIKE = (
    "{% for m in messages %}<｜User｜>{{ m.content }}{% endfor %}"
    "{% if tools %}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{% endif %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)


async def _no_worker(fn: Any) -> Any:
    return fn()


def _no_builtin(*_: Any) -> str:
    raise AssertionError("Jinja only")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}, "auto"])
def test_a_call_after_an_open_think_block_follows_the_reasoning(choice: Any) -> None:
    """DeepSeek's and MiniMax's prompts end inside ``<think>``: a reply read from there starts
    in its reasoning, a forced call's too (its grammar is held until the block closes:
    llama/thinking.py), and the call after the close tag is a call."""
    from hydra_trio.engine.chat import Chat

    tpl = ChatTemplate(name="t", source="inline", jinja=DEEPSEEK_LIKE)
    chat = Chat(tpl, tool_call_parser="auto", reasoning_format="auto", bos_token="<s>", eos_token="</s>",
                tokenizer_adds_bos=True, run_on_worker=_no_worker, apply_builtin=_no_builtin)
    assert chat.caps.tool_format is FORMATS["deepseek"]
    body = {
        "messages": [{"role": "user", "content": "time in Paris?"}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_time",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
        "tool_choice": choice,
    }
    call = (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": '
        '"Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    plan = chat_plan(chat, body)
    assert plan.prompt.endswith("<｜Assistant｜><think>\n"), plan.prompt
    make = plan.replies
    assert make is not None
    parser = make()
    deltas = [parser.feed(c) for c in "Paris, then.\n</think>\n\n" + call] + [parser.finish()]
    assert [(c.name, json.loads(c.arguments)) for d in deltas for c in d.tool_calls] == [
        ("get_time", {"city": "Paris"})
    ]
    assert "".join(d.reasoning for d in deltas) == "Paris, then."
    assert "".join(d.content for d in deltas) == ""


def test_kimi_call_index_is_bounded_in_the_grammar() -> None:
    """The grammar writes Kimi's ``functions.NAME:IDX`` with a bounded index: unbounded, a
    random-weight model wrote digits to max_tokens (found by the corpus benchmark)."""
    from hydra_trio.engine.chat.call_grammar import tools_grammar

    req = parse_tools(
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
            ],
            "tool_choice": "required",
        }
    )
    assert req is not None
    text = tools_grammar(req, FORMATS["kimi_k2"]).text
    assert "[0-9]+" not in text and "/[0-9]{1,5}/" in text
