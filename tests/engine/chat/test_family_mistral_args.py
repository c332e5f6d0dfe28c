"""Mistral's named calls (engine/chat/families/mistral_args.py), as llama.cpp's tests expect them
for its templates (tests/test-chat.cpp, models/templates/): ``[TOOL_CALLS]NAME[ARGS]{json}``
(Ministral 3 Reasoning 2512, Devstral Small 2507: ``mistral_args``) and
``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{json}`` (Mistral Small 3.2 2506: ``mistral_call_id``, the
model's id kept), several in a row, no closer. Their replies whole and split anywhere, a reply
the length cap cut keeping its whole calls, ``auto`` telling the three Mistral syntaxes apart
as llama.cpp does, and the grammar (forced and lazy) writing what the templates print. CASES
and write_calls are its part of the checks every family goes through (family_examples.py). Pure."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import pytest

from hydra_trio.engine.chat import ChatTemplate, ReplyParser, parse_reply, parse_tools, template_caps
from hydra_trio.engine.chat.call_grammar import tools_grammar
from hydra_trio.engine.chat.caps import detect_format
from hydra_trio.engine.chat.families import detection_order
from hydra_trio.engine.chat.formats import FORMATS
from hydra_trio.engine.chat.render import render_prompt
from hydra_trio.engine.structured import GuidanceCache

ARGS, WITH_ID = FORMATS["mistral_args"], FORMATS["mistral_call_id"]


def call(name: str, args: str, call_id: str | None = None) -> str:
    return f"[TOOL_CALLS]{name}" + (f"[CALL_ID]{call_id}" if call_id is not None else "") + f"[ARGS]{args}"


def write_calls(fmt: Any, calls: list[tuple[str, dict[str, Any]]], value: Any) -> str | None:
    """Calls as these templates print them (``tojson``), Mistral Small 3.2's with 9-character ids."""
    if fmt.name not in ("mistral_args", "mistral_call_id"):
        return None
    ids = (f"{i:09d}" if fmt.name == "mistral_call_id" else None for i in itertools.count(1))
    return "".join(call(n, json.dumps(a), next(ids)) for n, a in calls)


ONE = [("special_function", {"arg1": 1})]
TWO = [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]
# (format, reply, starts in reasoning, content, reasoning, calls), the tools test_tool_families.TOOLS'
CASES: list[tuple[str, str, bool, str, str, list[tuple[str, dict[str, Any]]]]] = [
    ("mistral_args", call("special_function", '{"arg1": 1}'), False, "", "", ONE),
    ("mistral_args", call("special_function", '{"arg1": 1}') + call("special_function_with_opt",
                                                                      '{"arg1": 1, "arg2": 2}'), False, "", "", TWO),
    ("mistral_args", "Hello, world!\nWhat's up?" + call("special_function", '{"arg1": 1}'), False,
     "Hello, world!\nWhat's up?", "", ONE),
    ("mistral_args", call("empty_args", "{}"), False, "", "", [("empty_args", {})]),
    ("mistral_args", call("nope", '{"a": 1}'), False, call("nope", '{"a": 1}'), "", []),  # undeclared: content
    ("mistral_args", "[TOOL_CALLS][" + json.dumps({"name": "special_function", "arguments": {"arg1": 1}}) + "]",
     False, "[TOOL_CALLS][" + json.dumps({"name": "special_function", "arguments": {"arg1": 1}}) + "]", "", []),
    ("mistral_call_id", call("special_function", '{"arg1": 1}', "123456789"), False, "", "", ONE),
    ("mistral_call_id", call("special_function", '{"arg1": 1}', "000000001")
     + call("special_function_with_opt", '{"arg1": 1, "arg2": 2}', "000000002"), False, "", "", TWO),
    ("mistral_call_id", "Let me see." + call("get_time", '{"city": "Tokyo"}', "abcDEF123"), False, "Let me see.",
     "", [("get_time", {"city": "Tokyo"})]),
    # the id is optional to the reader, as to llama.cpp's (``p.optional([CALL_ID] ...)``)
    ("mistral_call_id", call("special_function", '{"arg1": 1}'), False, "", "", ONE),
]

INT = {"type": "integer"}
# llama.cpp's special_function_tool and special_function_tool_with_optional_param (tests/test-chat.cpp)
TOOLS = parse_tools({"tools": [
    {"type": "function", "function": {"name": "special_function", "parameters": {
        "type": "object", "properties": {"arg1": INT}, "required": ["arg1"]}}},
    {"type": "function", "function": {"name": "special_function_with_opt", "parameters": {
        "type": "object", "properties": {"arg1": INT, "arg2": INT}, "required": ["arg1"]}}},
], "parallel_tool_calls": True})
THINK = ("[THINK]", "[/THINK]")

# llama.cpp's cases for these templates (tests/test-chat.cpp): (format, reply, reasoning, content,
# calls as (name, arguments, the id the model wrote or None)).
LLAMA_CASES: list[tuple[str, str, str, str, list[tuple[str, dict[str, Any], str | None]]]] = [
    # "Ministral-3-14B-Reasoning-2512" (its peg_tester block): plain, thinking, one call, thinking
    # then a call, two calls, and a fake call marker inside the reasoning
    ("mistral_args", "Hello, world!\nWhat's up?", "", "Hello, world!\nWhat's up?", []),
    ("mistral_args", "[THINK]I'm\nthinking[/THINK]Hello, world!\nWhat's up?", "I'm\nthinking",
     "Hello, world!\nWhat's up?", []),
    ("mistral_args", '[TOOL_CALLS]special_function[ARGS]{"arg1":1}', "", "", [("special_function", {"arg1": 1}, None)]),
    ("mistral_args", "[THINK]I'm\nthinking[/THINK]" + '[TOOL_CALLS]special_function[ARGS]{"arg1":1}',
     "I'm\nthinking", "", [("special_function", {"arg1": 1}, None)]),
    ("mistral_args", '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}'
     '[TOOL_CALLS]special_function_with_opt[ARGS]{"arg1": 1, "arg2": 2}', "", "",
     [("special_function", {"arg1": 1}, None), ("special_function_with_opt", {"arg1": 1, "arg2": 2}, None)]),
    ("mistral_args", '[THINK]Let me think about [TOOL_CALLS]special_function[ARGS]{"arg1":1} and more[/THINK]'
     '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}',
     'Let me think about [TOOL_CALLS]special_function[ARGS]{"arg1":1} and more', "",
     [("special_function", {"arg1": 1}, None)]),
    # "Mistral Small 3.2 - FUNC_BRACKET_TAG format": plain, one call with its id, two calls
    ("mistral_call_id", "Hello, world!\nWhat's up?", "", "Hello, world!\nWhat's up?", []),
    ("mistral_call_id", '[TOOL_CALLS]special_function[CALL_ID]123456789[ARGS]{"arg1": 1}', "", "",
     [("special_function", {"arg1": 1}, "123456789")]),
    ("mistral_call_id", '[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]{"arg1": 1}'
     '[TOOL_CALLS]special_function_with_opt[CALL_ID]000000002[ARGS]{"arg1": 1, "arg2": 2}', "", "",
     [("special_function", {"arg1": 1}, "000000001"),
      ("special_function_with_opt", {"arg1": 1, "arg2": 2}, "000000002")]),
    # "Devstral": plain, one call, content then a call
    ("mistral_args", '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}', "", "",
     [("special_function", {"arg1": 1}, None)]),
    ("mistral_args", "Hello, world!\nWhat's up?[TOOL_CALLS]special_function[ARGS]{\"arg1\": 1}", "",
     "Hello, world!\nWhat's up?", [("special_function", {"arg1": 1}, None)]),
]


def ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _calls(calls: list[Any]) -> list[tuple[str, Any, str | None]]:
    return [(c.name, json.loads(c.arguments), None if c.id.startswith("call_") else c.id) for c in calls]


def _read(name: str, pieces: list[str]) -> tuple[str, str, list[tuple[str, Any, str | None]]]:
    p = ReplyParser(FORMATS[name], parse_tools=True, reasoning=True, tools=TOOLS, new_id=ids(), think_tags=THINK)
    deltas = [p.feed(x) for x in pieces] + [p.finish()]
    return "".join(d.content for d in deltas), "".join(d.reasoning for d in deltas), _calls(
        [c for d in deltas for c in d.tool_calls]
    )


@pytest.mark.parametrize("case", LLAMA_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(LLAMA_CASES)])
def test_llama_cpps_mistral_replies_parse_whole_and_split_anywhere(case: Any) -> None:
    name, text, reasoning, content, calls = case
    r = parse_reply(text, FORMATS[name], parse_tools=True, reasoning=True, tools=TOOLS, new_id=ids(), think_tags=THINK)
    assert (r.content, r.reasoning, _calls(r.tool_calls)) == (content, reasoning, calls)
    assert [c.index for c in r.tool_calls] == list(range(len(calls)))
    for k in range(len(text) + 1):  # every split in two, and token-like pieces of three characters
        assert _read(name, [text[:k], text[k:]]) == (content, reasoning, calls), k
    assert _read(name, [text[i:i + 3] for i in range(0, len(text), 3)]) == (content, reasoning, calls)


def test_a_cut_reply_keeps_its_whole_calls() -> None:
    first = call("special_function", '{"arg1": 1}', "000000001")
    text = first + call("special_function_with_opt", '{"arg1": 1, "arg2": 2}', "000000002")
    for k in range(len(first), len(text)):  # cut anywhere in the second call
        p = ReplyParser(WITH_ID, parse_tools=True, reasoning=False, tools=TOOLS, new_id=ids())
        deltas = [p.feed(text[:k]), p.finish(cut=True)]
        assert "".join(d.content for d in deltas) == "", k
        assert _calls([c for d in deltas for c in d.tool_calls]) == [("special_function", {"arg1": 1}, "000000001")], k
    # the same reply ended (not cut) inside its second call: that call is content, as llama-server's
    half = text[: len(first) + 30]
    r = parse_reply(half, WITH_ID, parse_tools=True, reasoning=False, tools=TOOLS, new_id=ids())
    assert _calls(r.tool_calls) == [("special_function", {"arg1": 1}, "000000001")]
    assert r.content == half[len(first):]


def test_a_marker_without_a_call_is_content_and_the_next_one_is_read() -> None:
    """Any tool's name taken (no tools given): a second marker before ``[ARGS]`` is where the
    call starts, the first one's text content; a head that never reaches ``[ARGS]`` is content."""
    text = "[TOOL_CALLS]" + call("special_function", '{"arg1": 1}')
    for fmt in (ARGS, WITH_ID):
        r = parse_reply(text, fmt, parse_tools=True, reasoning=False, new_id=ids())
        assert (r.content, _calls(r.tool_calls)) == ("[TOOL_CALLS]", [("special_function", {"arg1": 1}, None)])
        cut = "[TOOL_CALLS]special_function"
        r = parse_reply(cut, fmt, parse_tools=True, reasoning=False, new_id=ids())
        assert (r.content, r.tool_calls) == (cut, [])
        long = "[TOOL_CALLS]" + "x" * 200 + '[ARGS]{"a": 1}'  # no tool's name is that long
        assert parse_reply(long, fmt, parse_tools=True, reasoning=False, new_id=ids()).content == long


# The templates' lines that tell them apart (llama.cpp's models/templates/), as they spell them
MISTRAL_SMALL_32 = (  # Mistral-Small-3.2-24B-Instruct-2506.jinja
    "{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}"
    "{{- '[TOOL_CALLS]' + tool_call.function.name }}{{- '[CALL_ID]' + tool_call.id }}"
    "{{- '[ARGS]' + tool_call['function']['arguments']|tojson }}"
)
DEVSTRAL = (  # unsloth-mistral-Devstral-Small-2507.jinja
    "{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}"
    "{{- \"[TOOL_CALLS]\" + tool['function']['name'] + \"[ARGS]\" + arguments }}"
)
MINISTRAL_3 = (  # mistralai-Ministral-3-14B-Reasoning-2512.jinja
    "{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}{{- '[THINK]' + block['thinking'] + '[/THINK]' }}"
    "{{- '[TOOL_CALLS]' }}{%- set name = tool['function']['name'] %}{{- name + '[ARGS]' + arguments }}"
)
MISTRAL_NEMO = (  # mistralai-Mistral-Nemo-Instruct-2407.jinja: one JSON list
    '{{- "[AVAILABLE_TOOLS][" }}{{- "[TOOL_CALLS][" }}{%- for tool_call in message.tool_calls %}'
)


@pytest.mark.parametrize(
    ("source", "name", "think"),
    [(MISTRAL_SMALL_32, "mistral_call_id", False), (DEVSTRAL, "mistral_args", False),
     (MINISTRAL_3, "mistral_args", True), (MISTRAL_NEMO, "mistral", False)],
    ids=["mistral-small-3.2", "devstral", "ministral-3", "mistral-nemo"],
)
def test_auto_tells_the_mistral_syntaxes_apart(source: str, name: str, think: bool) -> None:
    assert detect_format(source) is FORMATS[name]
    caps = template_caps(ChatTemplate(name="t", source="inline", jinja=source))
    assert caps.tool_format is FORMATS[name] and caps.as_dict()["tool_format"] == name
    assert (caps.think_tags == THINK) is think
    order = [fmt.name for _, fmt in detection_order()]
    assert order.index("mistral_call_id") < order.index("mistral_args") < order.index("mistral")
    # the markers are the syntax a reply shows (llama.cpp's preserved_tokens for Ministral 3)
    assert {"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"} <= set(WITH_ID.syntax_text())
    assert {"[TOOL_CALLS]", "[ARGS]"} <= set(ARGS.syntax_text())


def _accepts(grammar: Any, text: str) -> bool:
    """Whether ``grammar`` takes ``text`` whole and may end there (a vocabulary of bytes)."""
    cache = GuidanceCache([bytes([b]) for b in range(256)] + [b""], frozenset({256}), None)
    state = cache.new_state(grammar)
    return state.feed(text.encode()) and bool(state.allowed()[256])


def _request(choice: Any, *, parallel: bool = True) -> Any:
    return parse_tools({"tools": [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}}
                                  for t in TOOLS.tools], "tool_choice": choice, "parallel_tool_calls": parallel})


def test_the_grammar_writes_what_the_templates_print() -> None:
    """llama.cpp's calls for each template (its spacing included) are what the forced grammar
    allows, several in a row; the parser reads them back, with the model's ids."""
    for name, text, _, _, calls in LLAMA_CASES:
        if not calls or "[THINK]" in text or not text.startswith("[TOOL_CALLS]"):
            continue
        grammar = tools_grammar(_request("required"), FORMATS[name])
        assert _accepts(grammar, text), (name, text)
        assert _calls(parse_reply(text, FORMATS[name], parse_tools=True, reasoning=False, tools=TOOLS,
                                  new_id=ids()).tool_calls) == calls
    required = tools_grammar(_request("required"), WITH_ID)
    assert not _accepts(required, call("special_function", '{"arg1": 1}'))  # its template demands the id
    assert not _accepts(required, call("special_function", '{"arg1": 1}', "12345678"))  # of 9 characters
    assert not _accepts(required, call("special_function", '{"arg2": 1}', "123456789"))  # arg1 is required
    assert not _accepts(required, "")  # at least one call
    old = "[TOOL_CALLS][" + json.dumps({"name": "special_function", "arguments": {"arg1": 1}}) + "]"
    assert not _accepts(tools_grammar(_request("required"), ARGS), old)  # not the older list syntax
    # a named tool, or parallel calls off: exactly one call
    named = tools_grammar(_request({"type": "function", "function": {"name": "special_function_with_opt"}}), ARGS)
    assert _accepts(named, call("special_function_with_opt", '{"arg1": 1}'))
    assert not _accepts(named, call("special_function", '{"arg1": 1}'))
    assert not _accepts(named, call("special_function_with_opt", '{"arg1": 1}') * 2)
    one = tools_grammar(_request("required", parallel=False), ARGS)
    assert _accepts(one, call("special_function", '{"arg1": 1}'))
    assert not _accepts(one, call("special_function", '{"arg1": 1}') * 2)


@pytest.mark.parametrize("name", ["mistral_args", "mistral_call_id"])
def test_auto_is_lazy_from_the_tool_calls_marker(name: str) -> None:
    """As llama.cpp's word trigger ``[TOOL_CALLS]``: free text until the marker, which the grammar
    is fed from (text before it stays content)."""
    grammar = tools_grammar(_request("auto"), FORMATS[name])
    (pattern,) = grammar.triggers
    m = re.search(pattern, "Hello, world![TOOL_CALLS]")
    assert m is not None and m.group(1) == "[TOOL_CALLS]"
    assert re.search(pattern, "Hello, world![TOOL_CALL") is None
    fed = call("special_function", '{"arg1": 1}', "000000001" if name == "mistral_call_id" else None)
    assert _accepts(grammar, fed)


# Mistral-Small-3.2-24B-Instruct-2506.jinja's assistant turn with calls, as it prints them
SMALL_32_TURNS = (
    "{%- for message in messages %}{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' and message.get('tool_calls') %}"
    "{%- for tool_call in message.tool_calls %}{{- '[TOOL_CALLS]' + tool_call.function.name }}"
    "{%- if not tool_call.id is defined or tool_call.id is not string or tool_call.id|length != 9 %}"
    "{{- raise_exception(\"Tool call IDs should be alphanumeric strings with length 9!\") }}{%- endif %}"
    "{{- '[CALL_ID]' + tool_call.id }}{{- '[ARGS]' + tool_call['function']['arguments']|tojson }}"
    "{%- endfor %}{{- eos_token }}"
    # its tool results (restated shorter): the id they answer
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.tool_call_id }}[TOOL_CONTENT]{{ message.content }}"
    "[/TOOL_RESULTS]{%- endif %}{%- endfor %}"
)


def test_the_models_id_lets_its_template_print_the_call_back() -> None:
    """Mistral Small 3.2's template refuses a call id that is not 9 characters: the reply's
    calls, ids as the model wrote them, go back into the next turn's prompt as they were
    written; any other id is mapped to 9 letters and digits."""
    text = call("special_function", '{"arg1": 1}', "000000001") + call("special_function_with_opt",
                                                                        '{"arg1": 1, "arg2": 2}', "000000002")
    r = parse_reply(text, WITH_ID, parse_tools=True, reasoning=False, tools=TOOLS)
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in r.tool_calls]
    caps = template_caps(ChatTemplate(name="t", source="inline", jinja=SMALL_32_TURNS))
    request = {"messages": [{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "", "tool_calls": calls}]}
    prompt = render_prompt(request, SMALL_32_TURNS, caps, bos_token="<s>", eos_token="</s>")
    assert prompt == "[INST]hi[/INST]" + text + "</s>"
    # Ids of other makers (ours, Anthropic's, a client's): 9 letters and digits from each, the
    # same for a call and the result that answers it, and the same every turn (llama-server
    # hands the template the id as it is, which it refuses: "length 9").
    for other in ("call_" + "0" * 24, "toolu_01AbC-dEf_gh", "x"):
        calls[0]["id"] = other
        turn = {"messages": [*request["messages"], {"role": "tool", "tool_call_id": other, "content": "ok"}]}
        prompt = render_prompt(turn, SMALL_32_TURNS, caps, bos_token="<s>", eos_token="</s>")
        mapped = prompt.split("[CALL_ID]")[1].split("[ARGS]")[0]
        assert len(mapped) == 9 and mapped.isascii() and mapped.isalnum() and mapped != other
        assert f"[TOOL_RESULTS]{mapped}[TOOL_CONTENT]ok" in prompt
        assert render_prompt(turn, SMALL_32_TURNS, caps, bos_token="<s>", eos_token="</s>") == prompt
    assert "000000002" in prompt  # an id that is already 9 letters and digits is kept
