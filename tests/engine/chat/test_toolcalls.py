"""Tool calls in replies (engine/chat/parser.py, reasoning.py) and tool requests (tools.py):
each format's examples, the stream/whole-reply identity under any split, the think split,
and the request's validation naming its parameter. Pure: no model."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import family_examples
from hydra_trio.engine.chat import ReplyParser, ToolCall, parse_reply, parse_tools
from hydra_trio.engine.chat.caps import detect_format
from hydra_trio.engine.chat.families import ToolFormat
from hydra_trio.engine.chat.formats import FORMATS, GENERIC, tools_system_prompt
from hydra_trio.engine.chat.tools import MAX_TOOLS
from hydra_trio.engine.params import parse_generation
from hydra_trio.engine.structured import request_constraint
from hydra_trio.wire.errors import ParamError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "add", "description": "sum", "parameters": {"type": "object"}}},
]
REQ = parse_tools({"tools": TOOLS})
HERMES, LLAMA3, MISTRAL = FORMATS["hermes"], FORMATS["llama3"], FORMATS["mistral"]


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parse(text: str, fmt: ToolFormat, **kw: Any) -> Any:
    return parse_reply(text, fmt, parse_tools=True, reasoning=kw.pop("reasoning", False), tools=REQ, new_id=ids(), **kw)


def call_json(fmt: ToolFormat, name: str, args: dict[str, Any]) -> str:
    return json.dumps({"name": name, fmt.args_key: args})


def _xml(name: str, key: str, v: Any) -> str:
    """An argument as the XML families write it: a declared string as its text, else as JSON
    (the parser takes the text of a parameter the tool does not declare a string as JSON)."""
    tool = next((t["function"] for t in TOOLS if t["function"]["name"] == name), {})
    declared = tool.get("parameters", {}).get("properties", {}).get(key, {})
    return v if declared.get("type") == "string" else json.dumps(v)


def write_calls(fmt: ToolFormat, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Calls as the format writes them (as its grammar makes a model write them)."""
    if fmt.name in ("qwen3_coder", "seed_oss"):
        tag = "tool_call" if fmt.name == "qwen3_coder" else "seed:tool_call"
        return "\n".join(
            f"<{tag}>\n<function={n}>\n" + "".join(f"<parameter={k}>\n{_xml(n, k, v)}\n"
                                                   "</parameter>\n" for k, v in a.items())
            + f"</function>\n</{tag}>"
            for n, a in calls
        )
    if fmt.name in ("glm", "hy3"):
        s, sep = ("", "\n") if fmt.name == "glm" else (":opensource", "<tool_sep:opensource>\n")
        return fmt.before + "\n".join(
            f"<tool_call{s}>{n}{sep}"
            + "".join(f"<arg_key{s}>{k}</arg_key{s}>\n<arg_val"
                      f"ue{s}>{_xml(n, k, v)}</arg_value{s}>\n" for k, v in a.items())
            + f"</tool_call{s}>"
            for n, a in calls
        ) + fmt.after
    if fmt.name == "kimi_k2":
        return "<|tool_calls_section_begin|>" + "".join(
            f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
            for i, (n, a) in enumerate(calls)
        ) + "<|tool_calls_section_end|>"
    if fmt.name == "deepseek":
        return "<｜tool▁calls▁begin｜>" + "".join(
            f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>" for n, a in calls
        ) + "<｜tool▁calls▁end｜>"
    if fmt.name in ("minimax", "deepseek_dsml"):
        p, section = ("", "minimax:tool_call") if fmt.name == "minimax" else ("｜DSML｜", "｜DSML｜function_calls")
        return f"<{section}>" + "".join(
            f'\n<{p}invoke name="{n}">\n'
            + "".join(f'<{p}parameter name="{k}">{_xml(n, k, v)}</{p}parameter>\n' for k, v in a.items())
            + f"</{p}invoke>"
            for n, a in calls
        ) + f"\n</{section}>"
    if fmt.name == "gemma4":
        def value(v: Any) -> str:
            return f'<|"|>{v}<|"|>' if isinstance(v, str) else json.dumps(v)

        return "".join(
            f"<|tool_call>call:{n}{{" + ",".join(f"{k}:{value(v)}" for k, v in a.items()) + "}<tool_call|>"
            for n, a in calls
        )
    if fmt is HERMES:
        return "\n".join(f"<tool_call>\n{call_json(fmt, n, a)}\n</tool_call>" for n, a in calls)
    if fmt is LLAMA3:
        return "<|python_tag|>" + "; ".join(call_json(fmt, n, a) for n, a in calls)
    if fmt is MISTRAL:
        return "[TOOL_CALLS][" + ", ".join(call_json(fmt, n, a) for n, a in calls) + "]"
    if fmt.name == "cohere":
        return (
            "<|START_ACTION|>[\n"
            + ",\n".join(
                "    " + json.dumps({"tool_call_id": str(i), "tool_name": n, "parameters": a})
                for i, (n, a) in enumerate(calls)
            )
            + "\n]<|END_ACTION|>"
        )
    if fmt.name == "minimax_m1":
        return "<tool_calls>\n" + "\n".join(call_json(fmt, n, a) for n, a in calls) + "\n</tool_calls>"
    if fmt.name == "apertus":
        return "<|tools_prefix|>[" + ", ".join(json.dumps({n: a}) for n, a in calls) + "]<|tools_suffix|>"
    if fmt.name in ("gigachat3", "gigachat3_1"):
        return "".join(fmt.before + call_json(fmt, n, a) for n, a in calls)
    if fmt.name == "minicpm5":
        return "\n".join(
            f'<function name="{n}">'
            + "".join(f'<param name="{k}">{_xml(n, k, v)}</param>' for k, v in a.items())
            + "</function>"
            for n, a in calls
        )
    if fmt.name == "functionary":  # the first recipient's ">>>" ends the prompt
        return ">>>".join(f"{n}\n{json.dumps(a)}" for n, a in calls)
    if fmt.name == "solar":
        return "<|tool_calls|>" + "".join(
            f"<|tool_call:begin|>{i}<|tool_call:name|>{n}<|tool_call:args|>{json.dumps(a)}<|tool_call:end|>"
            for i, (n, a) in enumerate(calls)
        )
    if fmt.name == "kimi_k3":
        def k3_type(v: Any) -> str:
            return "string" if isinstance(v, str) else "number" if isinstance(v, int | float) else "object"

        return "<|open|>tools<|sep|>" + "".join(
            f'<|open|>call tool="{n}" index="{i + 1}"<|sep|>' + "".join(
                f'<|open|>argument key="{k}" type="{k3_type(v)}"<|sep|>{v if isinstance(v, str) else json.dumps(v)}'
                "<|close|>argument<|sep|>" for k, v in a.items()
            ) + "<|close|>call<|sep|>" for i, (n, a) in enumerate(calls)
        ) + "<|close|>tools<|sep|>"
    if fmt.name == "command_r_plus":
        return (
            "Action:\n```json\n["
            + ", ".join(json.dumps({"tool_name": n, "parameters": a}) for n, a in calls)
            + "]\n```"
        )
    if fmt.name == "lfm2":
        return "<|tool_call_start|>[" + ", ".join(
            f"{n}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in a.items()) + ")" for n, a in calls
        ) + "]<|tool_call_end|>"
    if fmt.name in ("granite", "nemotron", "apriel", "firefunction"):  # a JSON list between the format's literals
        return fmt.before + ", ".join(call_json(fmt, n, a) for n, a in calls) + fmt.after
    if (own := family_examples.write_calls(fmt, calls, _xml)) is not None:  # a family added since (its test module's)
        return own
    assert fmt.name == "generic", f"{fmt.name}: no writer of its calls (family_examples.py)"
    return '{"tool_calls": [' + ", ".join(call_json(fmt, n, a) for n, a in calls) + "]}"


def names_args(calls: list[ToolCall]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# The channel dialects (gpt-oss's harmony, Muse Glimmer) have their own tests (test_tool_families.py).
TEXT_FORMATS = {name: fmt for name, fmt in FORMATS.items() if not fmt.channels}


@pytest.mark.parametrize("fmt", list(TEXT_FORMATS.values()), ids=list(TEXT_FORMATS))
def test_each_format_parses_one_and_parallel_calls(fmt: ToolFormat) -> None:
    one = [("get_weather", {"city": "Paris"})]
    two = [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": [2, {"c": "}"}]})]
    for calls in (one, two):
        r = parse(write_calls(fmt, calls), fmt)
        assert r.content == ""
        assert names_args(r.tool_calls) == calls
        assert [c.index for c in r.tool_calls] == list(range(len(calls)))
        given = ([f"functions.{n}:{i}" for i, (n, _) in enumerate(calls)] if fmt.name == "kimi_k2"
                 # the model's own ids
                 else [str(i) for i in range(len(calls))] if fmt.name in ("cohere", "solar")
                 else [f"{i + 1:09d}" for i in range(len(calls))] if fmt.name == "mistral_call_id" else None)
        assert [c.id for c in r.tool_calls] == (given or [f"call_{i}" for i in range(len(calls))])
        assert r.tool_calls[0].arguments == json.dumps(calls[0][1], separators=(",", ":"))


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=["hermes", "llama3", "mistral"])
def test_text_before_and_after_a_call_is_content(fmt: ToolFormat) -> None:
    text = "Let me check the weather.\n\n" + write_calls(fmt, [("get_weather", {"city": "Oslo"})]) + "\nDone."
    r = parse(text, fmt)
    assert r.content == "Let me check the weather.Done."
    assert names_args(r.tool_calls) == [("get_weather", {"city": "Oslo"})]


def test_llama3_bare_json_at_the_start_and_generic_whitespace() -> None:
    r = parse('  {"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {}}', LLAMA3)
    assert r.content == "" and names_args(r.tool_calls) == [("add", {"a": 1}), ("add", {})]
    assert parse(' {"name": "add", "parameters": {}}', LLAMA3).tool_calls
    # llama3 also takes "arguments"; a bare object later in the text is not a call.
    assert parse('{"name": "add", "arguments": {"x": 2}}', LLAMA3).tool_calls[0].arguments == '{"x":2}'
    later = 'I would send {"name": "add", "parameters": {}}'
    assert parse(later, LLAMA3).content == later
    r = parse('\n{"tool_calls": [{"name": "add", "arguments": {}}]}\n', GENERIC)
    assert r.content == "" and names_args(r.tool_calls) == [("add", {})]


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),  # unfinished
        (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n'),  # no closer yet
        (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}} trailing'),  # no closer
        (HERMES, "<tool_call>\nnot json\n</tool_call>"),
        (HERMES, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'),  # unknown tool
        (HERMES, '<tool_call>{"name": "add", "arguments": "{}"}</tool_call>'),  # arguments not an object
        (HERMES, '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'),
        (HERMES, '<tool_call>{"name": "add", "arguments": {"x": NaN}}</tool_call>'),  # not JSON
        (HERMES, '<tool_call>{"arguments": {}}</tool_call>'),
        (LLAMA3, '{"name": "nope", "parameters": {}}'),
        (LLAMA3, '<|python_tag|>{"name": "add", "parameters": 3}'),
        (LLAMA3, '{"name": "add", "parameters": {'),
        # all or nothing
        (MISTRAL, '[TOOL_CALLS][{"name": "add", "arguments": {}}, {"name": "nope", "arguments": {}}]'),
        (MISTRAL, '[TOOL_CALLS]{"name": "add", "arguments": {}}'),  # not a list
        (MISTRAL, "[TOOL_CALLS][]"),
        (GENERIC, '{"tool_calls": [{"name": "add", "arguments": 5}]}'),
        (GENERIC, '{"answer": 42}'),
        (GENERIC, '{"tool_calls": []}'),
    ],
)
def test_a_malformed_or_unknown_call_is_content(fmt: ToolFormat, text: str) -> None:
    r = parse(text, fmt)
    assert r.tool_calls == []
    assert r.content == text


def test_a_bad_call_between_good_ones_stays_content_and_indexes_count_calls() -> None:
    good = '<tool_call>{"name": "add", "arguments": {"n": %d}}</tool_call>'
    bad = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    r = parse(good % 0 + "\n" + bad + "\n" + good % 1, HERMES)
    assert r.content == bad
    assert [(c.index, json.loads(c.arguments)["n"]) for c in r.tool_calls] == [(0, 0), (1, 1)]


def test_without_tool_parsing_everything_is_content() -> None:
    text = write_calls(HERMES, [("add", {})])
    r = parse_reply(text, HERMES, parse_tools=False, reasoning=False)
    assert r.content == text and r.tool_calls == []


def test_any_name_is_a_call_without_a_tool_list() -> None:
    r = parse_reply('<tool_call>{"name": "whatever", '
                    '"arguments": {}}</tool_call>', HERMES, parse_tools=True, reasoning=False)
    assert [c.name for c in r.tool_calls] == ["whatever"]
    assert r.tool_calls[0].id.startswith("call_") and len(r.tool_calls[0].id) == 5 + 24


def test_streaming_holds_only_what_may_be_a_marker() -> None:
    p = ReplyParser(HERMES, parse_tools=True, reasoning=False, tools=REQ, new_id=ids())
    assert p.feed("Hello").content == "Hello"
    assert p.feed(" <tool").content == ""  # " " (whitespace before a possible call) and "<tool" held
    assert p.feed("box>").content == " <toolbox>"  # could not be a marker: released at once
    assert p.feed("<tool_call>\n{").content == ""
    d = p.feed('"name": "add", "arguments": {}}\n</tool_call>')
    assert d.content == "" and [c.name for c in d.tool_calls] == ["add"]
    assert p.feed("\n").content == ""
    assert p.finish().content == ""  # whitespace after the last call: dropped
    assert p.content == "Hello <toolbox>" and len(p.calls) == 1


# ---- the stream is the whole reply, however it is split ------------------------------------

_JUNK = st.lists(
    st.one_of(
        st.text("ab <>[]{}\";:\n\\/|_", max_size=6),
        st.sampled_from(
            ["<tool_call>", "</tool_call>", "<tool", "[TOOL_CALLS]", "[TOOL", "<|python_tag|>", "<|py", "<think>",
             "</think>",
             "</th", "{", "}", "[", "]", '"', '{"name": "add", "arguments": {}}', '{"name": "add", "parameters": {}}',
             '{"tool_calls": [', "; ", "\n", "  ", "<function=add>", "</function>", "<parameter=x>", "</parameter>",
             "<arg_key>", "</arg_value>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
             "<｜tool▁calls▁begin｜>",
             "<｜tool▁sep｜>", '<invoke name="add">', "</minimax:tool_call>"]
        ),
    ),
    max_size=12,
).map("".join)


@st.composite
def replies(draw: st.DrawFn, fmt: ToolFormat) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """A reply in ``fmt``: optional reasoning, text, calls (a few groups for hermes)."""
    args = st.dictionaries(
        st.text("xyz", min_size=1, max_size=3), st.one_of(st.integers(), st.text('a"}{ \\', max_size=4)), max_size=3
    )
    calls = draw(st.lists(st.tuples(st.sampled_from(["get_weather", "add"]), args), max_size=3))
    think = draw(st.sampled_from(["", "<think>\nplan </think>\n", "<think>a\n\n</think>"]))
    lead_ok = fmt in (HERMES, MISTRAL) or fmt.block is not None
    before = draw(st.sampled_from(["", "Sure. ", "text <tool ", "x\n"])) if lead_ok else ""
    text = think + before + (write_calls(fmt, calls) if calls else draw(_JUNK))
    return text, calls


def _splits(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _streamed(pieces: list[str], fmt: ToolFormat, reasoning: bool, starts_in: bool) -> tuple[str, str, list[ToolCall]]:
    p = ReplyParser(fmt, parse_tools=True, reasoning=reasoning, starts_in_reasoning=starts_in, tools=REQ, new_id=ids())
    deltas = [p.feed(x) for x in pieces] + [p.finish()]
    content = "".join(d.content for d in deltas)
    assert content == p.content
    assert [c for d in deltas for c in d.tool_calls] == p.calls
    return content, "".join(d.reasoning for d in deltas), p.calls


@pytest.mark.parametrize("fmt", list(TEXT_FORMATS.values()), ids=list(TEXT_FORMATS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_split_of_a_reply_gives_the_whole_replys_parse(fmt: ToolFormat, data: st.DataObject) -> None:
    text, calls = data.draw(st.one_of(replies(fmt), _JUNK.map(lambda t: (t, None))))
    reasoning, starts_in = data.draw(st.booleans()), data.draw(st.booleans())
    whole = parse_reply(
        text, fmt, parse_tools=True, reasoning=reasoning, starts_in_reasoning=starts_in, tools=REQ, new_id=ids()
    )
    assert _streamed(_splits(data.draw, text), fmt, reasoning, starts_in) == (
        whole.content,
        whole.reasoning,
        whole.tool_calls,
    )
    if calls and reasoning and not starts_in:
        assert names_args(whole.tool_calls) == calls  # what the format writes is parsed back


# ---- reasoning --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "starts_in", "reasoning", "content"),
    [
        ("<think>\nI should add.\n</think>\n\nThe sum is 3.", False, "I should add.", "The sum is 3."),
        ("  <think>a</think>b", False, "a", "b"),
        ("<think>\n\nx\n\n</think>", False, "\nx\n", ""),
        ("<think>unclosed", False, "unclosed", ""),
        ("no think <think>here</think>", False, "", "no think <think>here</think>"),
        ("\nstill thinking\n</think>answer", True, "still thinking", "answer"),
        ("<thi", False, "", "<thi"),
        ("", False, "", ""),
    ],
)
def test_reasoning_is_split_from_the_content(text: str, starts_in: bool, reasoning: str, content: str) -> None:
    r = parse_reply(text, GENERIC, parse_tools=False, reasoning=True, starts_in_reasoning=starts_in)
    assert (r.reasoning, r.content) == (reasoning, content)
    off = parse_reply(text, GENERIC, parse_tools=False, reasoning=False)
    assert (off.reasoning, off.content) == ("", text)


def test_reasoning_then_a_call() -> None:
    text = "<think>\nweather needed\n</think>\n" + write_calls(HERMES, [("get_weather", {"city": "Rome"})])
    r = parse(text, HERMES, reasoning=True)
    assert (
        r.reasoning == "weather needed"
        and r.content == ""
        and names_args(r.tool_calls) == [("get_weather", {"city": "Rome"})]
    )


# ---- formats from templates --------------------------------------------------------------------


def test_detect_format_from_template_source() -> None:
    assert detect_format("{% if tools %}<tool_call>{{ tool }}</tool_call>{% endif %}") is HERMES
    assert detect_format("[AVAILABLE_TOOLS]...[TOOL_CALLS]") is MISTRAL
    assert detect_format("<|python_tag|>") is LLAMA3
    assert detect_format("{{ 'ipython' }} ... parameters") is LLAMA3
    assert detect_format("{{ messages }}") is GENERIC
    assert detect_format("") is GENERIC


def test_the_generic_system_prompt_describes_tools_and_the_reply_form() -> None:
    text = tools_system_prompt(
        parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}})
    )
    assert '"name": "add"' in text and "get_weather" not in text
    assert '{"tool_calls": [' in text and "You must call add." in text
    assert "plain text" in tools_system_prompt(REQ)


# ---- the request side -----------------------------------------------------------------------


def test_parse_tools_reads_tools_choice_and_parallel() -> None:
    assert parse_tools({}) is None and parse_tools({"tools": []}) is None
    assert parse_tools({"tool_choice": "none"}) is None and parse_tools({"tool_choice": "auto"}) is None
    r = parse_tools({"tools": TOOLS})
    assert r is not None and (r.choice, r.function, r.parallel) == ("auto", None, True)
    assert r.tools[0].parameters == {"type": "object", "properties": {"city": {"type": "string"}}}
    assert r.tools[1].description == "sum" and not r.tools[1].strict
    r = parse_tools(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}, "parallel_tool_calls": False}
    )
    assert r is not None and (r.choice, r.function, r.parallel) == ("function", "add", False)
    assert [t.name for t in r.callable] == ["add"]
    noparams = parse_tools({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]})
    assert (
        noparams is not None
        and noparams.tools[0].parameters == {"type": "object", "properties": {}}
        and noparams.tools[0].strict
    )
    legacy = parse_tools({"functions": [{"name": "f"}], "function_call": {"name": "f"}})
    assert legacy is not None and (legacy.choice, legacy.function, legacy.parallel) == ("function", "f", False)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tools": {}}, "tools", "array"),
        ({"tools": [5]}, "tools[0]", "object"),
        ({"tools": [{"type": "fn", "function": {"name": "a"}}]}, "tools[0].type", "function"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "object"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "1 to 64"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name", "1 to 64"),
        ({"tools": [{"type": "function", "function": {"name": "a", "description": 3}}]},
         "tools[0].function.description", "string"),
        ({"tools": [{"type": "function", "function": {"name": "a", "parameters": []}}]}, "tools[0].function.parameters",
         "schema"),
        ({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"description": "x" * 70000}}}]},
         "tools[0].function.parameters", "at most 65536"),
        ({"tools": [{"type": "function", "function": {"name": "a", "strict": "yes"}}]}, "tools[0].function.strict",
         "boolean"),
        ({"tools": [*TOOLS, TOOLS[0]]}, "tools[2].function.name", "twice"),
        ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]}, "tools",
         "at most 128"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "one of"),
        ({"tools": TOOLS, "tool_choice": 3}, "tool_choice", "string or an object"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "function"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "zz"}}}, "tool_choice", "not among"),
        ({"tool_choice": "required"}, "tool_choice", "declares no tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "a"}}}, "tool_choice", "declares no tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({"tools": TOOLS, "functions": [{"name": "a"}]}, "functions", "not both"),
        ({"functions": [{"name": "a"}], "tool_choice": "auto"}, "tool_choice", "function_call"),
        ({"tools": TOOLS, "function_call": "auto"}, "function_call", "tool_choice"),
        ({"functions": [{"name": "a"}], "function_call": "required"}, "function_call", "one of"),
        ({"functions": [{"name": "a"}], "function_call": {"name": "b"}}, "function_call", "not among"),
        ({"functions": "a"}, "functions", "array"),
        ({"functions": [{"name": "a", "parameters": 1}]}, "functions[0].parameters", "schema"),
    ],
)
def test_parse_tools_refusals_name_the_param(body: dict[str, Any], param: str, says: str) -> None:
    with pytest.raises(ParamError) as info:
        parse_tools(body)
    assert info.value.param == param, info.value
    assert says in info.value.message


def test_tools_are_a_constraint_unless_choice_none() -> None:
    def constraint(body: dict[str, Any]) -> Any:
        return request_constraint(body, parse_tools(body))

    c = constraint({"tools": TOOLS, "tool_choice": "required"})
    assert (
        c is not None and c.kind == "tools" and c.param == "tools" and c.value.choice == "required" and c.answer is None
    )
    assert constraint({"tools": TOOLS, "tool_choice": "none"}) is None
    assert constraint({"tools": TOOLS, "tool_choice": "none", "grammar": 'root ::= "a"'}).kind == "gbnf"
    # Beside a typed answer: auto is "a call or the answer"; required and named are calls.
    fmt = {"type": "json_object"}
    auto = constraint({"tools": TOOLS, "response_format": fmt})
    assert auto.kind == "tools" and auto.answer is not None and auto.answer.kind == "json_object"
    assert constraint({"tools": TOOLS, "tool_choice": "required", "response_format": fmt}).answer is None
    with pytest.raises(ParamError) as info:
        constraint({"tools": TOOLS, "grammar": 'root ::= "a"'})
    assert info.value.param == "grammar" and "with tools is not supported" in info.value.message
    params = parse_generation({"tools": TOOLS}, default_n_predict=8, n_ctx=64)
    assert params.constraint is not None and params.constraint.value == params.tools
    assert params.sampling.grammar is None  # written by the chat plan, not here
    none = parse_generation({"tools": TOOLS, "tool_choice": "none"}, default_n_predict=8, n_ctx=64)
    assert none.constraint is None and none.tools is not None and none.tools.choice == "none"
