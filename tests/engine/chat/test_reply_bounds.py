"""Reply parsers bounded in depth and in work (issue 50). A model's output of any depth or size
never makes a tool-call parser raise: JSON nested past the bound (wire/jsontext.py
``MAX_MODEL_DEPTH``) is not a call and stays content, whole and streamed alike, with tools
declared and, for the formats that drop markup, without. And every parser is linear in its
input however it is split: long whitespace, repeated openers and repeated inner tags cost
four times as much at four times the length, not sixteen (a generous CPU-time bound, below).

The replies are each family's own (tests/engine/chat/test_tool_families.py's cases, the JSON formats' from
their ``ToolFormat``), with the argument's value replaced. Pure."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import family_examples
from hydra_trio.engine.chat import ReplyParser, parse_reply
from hydra_trio.engine.chat.formats import FORMATS, ToolFormat
from hydra_trio.wire.jsontext import MAX_MODEL_DEPTH, parse_json
from test_tool_families import CASES, ONE, TOOLS, _tags

ARG = "\x00ARG\x00"  # where a reply's argument value goes


def _value_slot(text: str) -> str | None:
    """``text`` with its first ``arg1`` value (the digit 1) replaced by ARG."""
    m = re.search(r"arg1.{0,60}?(?<![\w.])1(?![\w.])", text, re.S)
    return None if m is None else text[: m.end() - 1] + ARG + text[m.end():]


OWN = {
    "gemma4": "<|tool_call>call:special_function{arg1:" + ARG + "}<tool_call|>",
    "minicpm5": '<function name="special_function"><param name="arg1">' + ARG + "</param></function>",
}


def _one_call(fmt: ToolFormat) -> str:
    """A reply of ``fmt`` that calls special_function with arg1 = ARG (after an empty think
    block where the family's case starts inside one)."""
    if fmt.name in OWN:  # their cases call special_function only beside another call
        return OWN[fmt.name]
    for name, text, starts_in, _content, _reasoning, calls in CASES:
        if name == fmt.name and calls == ONE and (slot := _value_slot(text)) is not None:
            return (_tags(fmt).get("think_tags", ("<think>", "</think>"))[0] if starts_in else "") + slot
    call = json.dumps({"name": "special_function", fmt.args_key: {"arg1": 0}}).replace("0}", ARG + "}")
    if fmt.listed or fmt.list_key:  # the calls' list (the grammar's own spelling of it)
        return fmt.before + call + fmt.after
    return (fmt.before if not fmt.before_optional else "") + fmt.call_open + call + fmt.call_close + fmt.after


REPLIES = {name: _one_call(fmt) for name, fmt in FORMATS.items()}


def _parse(fmt: ToolFormat, text: str, *, tools: bool = True, step: int = 0) -> tuple[str, str, list[tuple[str, str]]]:
    """(content, reasoning, calls) of ``text``: whole, or streamed ``step`` characters a piece."""
    kw: dict[str, Any] = {"parse_tools": tools, "reasoning": True, "tools": TOOLS if tools else None, **_tags(fmt)}
    if not step:
        r = parse_reply(text, fmt, **kw)
        return r.content, r.reasoning, [(c.name, c.arguments) for c in r.tool_calls]
    p = ReplyParser(fmt, **kw)
    deltas = [p.feed(text[i:i + step]) for i in range(0, len(text), step)] + [p.finish()]
    return "".join(d.content for d in deltas), "".join(d.reasoning for d in deltas), [
        (c.name, c.arguments) for d in deltas for c in d.tool_calls
    ]


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def test_every_format_has_a_one_call_reply() -> None:
    for name, reply in REPLIES.items():
        shallow = _parse(FORMATS[name], reply.replace(ARG, "[[1]]"))
        assert shallow[2] and json.loads(shallow[2][0][1]) == {"arg1": [[1]]}, (name, reply, shallow)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_nesting_a_thousand_deep_is_content_not_a_crash(name: str) -> None:
    fmt = FORMATS[name]
    for deep in ("[" * 1000 + "]" * 1000, '{"a":' * 1000 + "1" + "}" * 1000, "[" * 5000):
        text = REPLIES[name].replace(ARG, deep)
        whole = _parse(fmt, text)
        assert _parse(fmt, text, step=7) == whole
        for _, arguments in whole[2]:  # XML families keep a value that is not JSON as its text
            assert _depth(json.loads(arguments)) <= MAX_MODEL_DEPTH + 1, name
        if name not in XML_VALUES:
            assert whole[2] == [] and deep in whole[0], name  # left as it was written
        if fmt.dropped or fmt.recipient:  # their markup is read without tools too: no call then
            assert _parse(fmt, text, tools=False)[2] == []
    within = MAX_MODEL_DEPTH - 4  # a family's own JSON around the value takes up to four levels
    parsed = _parse(fmt, REPLIES[name].replace(ARG, "[" * within + "]" * within))[2]
    assert len(parsed) == 1 and _depth(json.loads(parsed[0][1])["arg1"]) == within, name


# Families whose parameter values are text, read as JSON where they are JSON (else kept as text).
XML_VALUES = {
    "qwen3_coder",
    "seed_oss",
    "glm",
    "hy3",
    "minimax",
    "deepseek_dsml",
    "minicpm5",
    "kimi_k3",
    "muse_glimmer",
    *family_examples.XML_VALUES,
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_arguments_that_cannot_be_written_out_are_not_a_call(name: str) -> None:
    """A lone surrogate escape and numbers past a float are not JSON that can be written back."""
    fmt = FORMATS[name]
    for value in ('"\\ud800"', "1e999", "NaN"):
        text = REPLIES[name].replace(ARG, value)
        whole = _parse(fmt, text)
        assert _parse(fmt, text, step=5) == whole
        for _, arguments in whole[2]:  # strict JSON, UTF-8 (an XML value's text may say NaN)
            parse_json(arguments.encode("utf-8"), "arguments")


# ---- linear in the input ----------------------------------------------------------------------

SIZE = 2000  # characters of the smaller input; the larger is four times as long
TAG = re.compile(r"<[^<>\n]{1,40}>|\[[A-Z_]{3,20}\]")  # a tag in a family's reply: <...>, <|...|>, [TOOL_CALLS]


def _openers(fmt: ToolFormat) -> list[str]:
    block = fmt.block
    found = [*(block.openers if block else ()), fmt.opener, *fmt.dropped, *(t.text for t in fmt.triggers)]
    return [m for m in dict.fromkeys(found) if m] or ["<|channel|>"]


def _closers(fmt: ToolFormat) -> list[str]:
    block = fmt.block
    return [m for m in dict.fromkeys([*((block.closer, block.tail) if block else ()), fmt.closer, "<|call|>"]) if m]


def shapes(name: str) -> list[tuple[str, str, str]]:
    """(head, unit, tail) of the hostile inputs head + unit * n + tail a family's reader meets:
    an opener then whitespace (closed or not), an opener again and again, whitespace inside a
    call where its value goes, and each tag of the family's own reply again and again there."""
    fmt = FORMATS[name]
    reply = REPLIES[name]
    before, after = reply.split(ARG)
    after = "1" + after
    out = []
    for o in _openers(fmt):
        out += [(o, " ", c) for c in _closers(fmt)] + [(o, "\n", ""), ("", o, ""), ("", o + " x", _closers(fmt)[0])]
    out += [(before, " ", after), (before, "\n\t", "")]
    out += [(before, tag, after) for tag in dict.fromkeys(TAG.findall(reply))]
    out += [(before, '"', after), (before, "[", after), (before, "{", after)]
    return out


def _cpu_s(fmt: ToolFormat, text: str, reps: int = 1) -> float:
    """CPU time of reading ``text`` whole and streamed, least of ``reps`` (this thread's own
    time: other work on the machine does not count)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        _parse(fmt, text)
        _parse(fmt, text, step=4)
        best = min(best, time.thread_time() - t0)
    return best


def _linear(name: str, head: str, unit: str, tail: str) -> None:
    """Why time and not a count of characters looked at: the readers are regexes and str
    methods in C, which nothing here can count. CPU time at SIZE and 4 x SIZE: linear work
    is ~4x, quadratic ~16x. The bound (8x, plus 10 ms for a timer's grain) fails a quadratic
    reader, as each of the readers before issue 50 did (hermes' and Qwen's whitespace after
    an opener, kimi_k2's and deepseek's regexes, repeated XML tags), and leaves twice the
    room a shared machine's noise needs; a reading over it is taken again, least of three."""
    fmt = FORMATS[name]
    n = max(1, SIZE // len(unit))
    small, large = head + unit * n + tail, head + unit * (4 * n) + tail
    t_small, t_large = _cpu_s(fmt, small), _cpu_s(fmt, large)
    if t_large > 8 * t_small + 0.01:
        t_small, t_large = _cpu_s(fmt, small, 3), _cpu_s(fmt, large, 3)
    assert t_large <= 8 * t_small + 0.01, (name, head[-40:], unit[:40], tail[:40], t_small, t_large)


@pytest.mark.slow  # a timing test: ~1 minute on a 2-core machine
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_familys_hostile_shapes_cost_linear_work(name: str) -> None:
    for head, unit, tail in shapes(name):
        _linear(name, head, unit, tail)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FORMATS))
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_mix_of_a_familys_marks_costs_linear_work(name: str, data: st.DataObject) -> None:
    """The shapes above, mixed: any head and tail around any repeated piece of the reply."""
    fmt = FORMATS[name]
    reply = REPLIES[name].replace(ARG, "1")
    marks = [*_openers(fmt), *_closers(fmt), *TAG.findall(reply)]
    a = data.draw(st.integers(0, len(reply) - 1))
    unit = data.draw(st.sampled_from([*marks, " ", reply[a:a + data.draw(st.integers(1, 40))]]))
    head = data.draw(st.sampled_from(["", *marks, reply[:a]]))
    tail = data.draw(st.sampled_from(["", *marks, reply[a:]]))
    _linear(name, head, unit, tail)


@pytest.mark.parametrize("name", sorted(FORMATS))
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_text_of_a_familys_marks_parses_the_same_however_split(name: str, data: st.DataObject) -> None:
    """Model output is anything: pieces of the family's markup and reply, brackets, quotes,
    whitespace, in any order, never raise, and any split of it reads as the whole does."""
    fmt = FORMATS[name]
    reply = REPLIES[name].replace(ARG, "1")
    pieces = [
        *_openers(fmt),
        *_closers(fmt),
        *TAG.findall(reply),
        reply,
        "[",
        "]",
        "{",
        "}",
        '"',
        "\\",
        " ",
        "\n",
        "x",
        "1",
    ]
    text = "".join(data.draw(st.lists(st.sampled_from(pieces), max_size=30)))
    whole = _parse(fmt, text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    p = ReplyParser(fmt, parse_tools=True, reasoning=True, tools=TOOLS, **_tags(fmt))
    deltas = [p.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)] + [p.finish()]
    streamed = ("".join(d.content for d in deltas), "".join(d.reasoning for d in deltas),
                [(c.name, c.arguments) for d in deltas for c in d.tool_calls])
    assert streamed == whole
