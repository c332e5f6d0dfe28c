"""The schema keywords agents and pydantic/zod send (issue 40): each is enforced by the grammar,
so every reply on the random-weight tiny model validates (``jsonschema``, formats checked);
a schema no value can satisfy is a 400 saying so; counts that would size the grammar are
refused before any grammar text is built. And the exact ranges the converter writes for
integer and number bounds, checked value by value."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import assert_server_healthy, chat, http
from hydra_trio.engine.chat.grammar import schema_gbnf
from hydra_trio.engine.llama.schema import int_range, number_range
from hydra_trio.wire.errors import ProtocolError

NAME = {"type": "string", "maxLength": 6}
KEYWORD_SCHEMAS: dict[str, dict[str, Any]] = {
    "integer_closed": {"type": "integer", "minimum": 0, "maximum": 10**9},  # pydantic Field(ge=0, le=10**9)
    "integer_open": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 300},
    "integer_min_only": {"type": "integer", "minimum": 1},  # Claude Code's limits
    "integer_max_only": {"type": "integer", "maximum": -7},
    "number_closed": {"type": "number", "minimum": 0, "maximum": 1},
    "number_open": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 2.5},
    "number_negative": {"type": "number", "minimum": -3.5, "maximum": -1},
    "pattern_anchored": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
    "pattern_alternatives": {"type": "string", "pattern": "^(get|put|delete)$"},
    "date": {"type": "string", "format": "date"},
    "time": {"type": "string", "format": "time"},
    "date_time": {"type": "string", "format": "date-time"},
    "uuid": {"type": "string", "format": "uuid"},
    "email": {"type": "string", "format": "email"},
    "ipv4": {"type": "string", "format": "ipv4"},
    "string_lengths": {"type": "string", "minLength": 2, "maxLength": 5},
    "items_counts": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    "const": {"const": "fixed"},
    "enum": {"enum": ["red", "green", 3, None]},
    "ref_defs": {
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["x"]}},
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/Point"}},
        "required": ["p"],
        "additionalProperties": False,
    },
    "any_of": {"anyOf": [{"type": "integer", "minimum": 10, "maximum": 20}, NAME]},
    "nullable_openapi": {"type": "integer", "minimum": 0, "maximum": 5, "nullable": True},
    "nullable_type_list": {"type": ["string", "null"], "maxLength": 4},
    "pydantic_all_of_ref": {
        "$defs": {"Color": {"enum": ["red", "blue"], "type": "string"}},
        "type": "object",
        "properties": {"c": {"allOf": [{"$ref": "#/$defs/Color"}], "description": "a color"}},
        "required": ["c"],
    },
}


def _wrapped(schema: dict[str, Any]) -> dict[str, Any]:
    """The keyword's schema as an object's required property (bounded otherwise)."""
    defs = schema.get("$defs")
    inner = {k: v for k, v in schema.items() if k != "$defs"}
    out: dict[str, Any] = {
        "type": "object",
        "properties": {"v": inner, "n": NAME},
        "required": ["v", "n"],
        "additionalProperties": False,
    }
    if defs:
        out["$defs"] = defs
    return out


FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.mark.parametrize("keyword", sorted(KEYWORD_SCHEMAS))
async def test_each_keyword_gives_only_valid_replies(start_engine: Any, tiny_model: Path, keyword: str) -> None:
    ep = await start_engine(tiny_model, slots=2)
    schema = _wrapped(KEYWORD_SCHEMAS[keyword])
    async with http(ep) as h:
        for i, content in enumerate(("hello world", "a story", "the model")):
            sampled = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": i} if i else {}
            body = await chat(
                h, messages=[{"role": "user", "content": content}], json_schema=schema, max_tokens=400, **sampled
            )
            choice = body["choices"][0]
            assert choice["finish_reason"] == "stop", choice
            value = json.loads(choice["message"]["content"])
            jsonschema.Draft202012Validator(schema, format_checker=FORMATS).validate(value)


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 is over maxLength 2"),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems 3 is over maxItems 1"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "types integer, string at once"),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": False}, "'b' is required"),
        ({"type": "string", "pattern": "^[z-a]$"}, "not a valid regular expression"),
        ({"type": "integer", "minimum": 3, "maximum": 2}, "no integer lies within"),
        ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}, "no integer lies within"),
        ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "no number lies within"),
        ({"type": "string", "enum": [1, 2]}, "no enum value"),
        ({"enum": []}, "enum is empty"),
        ({"type": "integer", "const": "x"}, "const is not"),
    ],
)
async def test_unsatisfiable_schemas_are_400(engine: Any, schema: dict[str, Any], says: str) -> None:
    async with http(engine) as h:
        r = await h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "json_schema": schema})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "json_schema", err
        assert "no value can satisfy the schema" in err["message"] and says in err["message"], err
        assert not re.search(r"\d\d:\d\d:\d\d", err["message"]), err  # the problem, never a log line
    await assert_server_healthy(engine)


def test_a_huge_count_is_refused_before_any_grammar_text() -> None:
    """The 60-byte schema that took 1.7 GB and froze the loop: refused by the check alone."""
    with pytest.raises(ProtocolError, match="too large: minLength 100000000 is over 2000"):
        schema_gbnf({"type": "string", "minLength": 100_000_000}, "json_schema")
    with pytest.raises(ProtocolError, match="add up to over"):
        schema_gbnf({"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 2000} for i in range(20)}}, "json_schema")
    with pytest.raises(ProtocolError, match="too large"):
        schema_gbnf({"type": "string", "pattern": "^a{0,100000}$"}, "json_schema")


def test_a_required_property_not_declared_is_written() -> None:
    """The converter writes only declared properties: a required one it was not told of is
    declared (any value), so the grammar cannot end the object without it."""
    gbnf = schema_gbnf({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a", "b"]}, "json_schema")
    assert 'root ::= "{" space a-kv "," space b-kv' in gbnf, gbnf


def test_what_cannot_be_enforced_is_refused_naming_the_keyword() -> None:
    for key, value in (("multipleOf", 3), ("uniqueItems", True), ("not", {})):
        with pytest.raises(ProtocolError, match=f"'{key}' is not supported"):
            schema_gbnf({"type": "integer", key: value}, "json_schema")


# ---- the ranges, value by value ----------------------------------------------------------------


def _regex(gbnf: str) -> re.Pattern[str]:
    """int_range / number_range's GBNF (literals, classes, counts) as a Python regex."""
    out = re.sub(r'"([^"]*)"', lambda m: re.escape(m.group(1)), gbnf).replace(" ", "")
    return re.compile(out.replace("[0-9]{1,15}", "[0-9]{1,3}").replace("[0-9]{0,14}", "[0-9]{0,2}"))


BOUND = st.one_of(st.none(), st.integers(-2500, 2500), st.integers(-10**7, 10**7))


@settings(max_examples=300, deadline=None)
@given(lo=BOUND, hi=BOUND, probes=st.lists(st.integers(-10**7, 10**7), max_size=20))
def test_int_range_is_exactly_the_range(lo: int | None, hi: int | None, probes: list[int]) -> None:
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    r = _regex(int_range(lo, hi))
    edges = [b + d for b in (lo, hi, 0) if b is not None for d in range(-12, 13)]
    for v in [*edges, *probes]:
        assert bool(r.fullmatch(str(v))) == ((lo is None or v >= lo) and (hi is None or v <= hi)), (lo, hi, v)
    for spelling in ("-0", "01", "00", "-01", "+1"):
        assert not r.fullmatch(spelling)


NUM_BOUND = st.one_of(st.none(), st.integers(-30, 30), st.integers(-300, 300).map(lambda x: x / 10))


@settings(max_examples=300, deadline=None)
@given(lo=NUM_BOUND, lo_x=st.booleans(), hi=NUM_BOUND, hi_x=st.booleans(), probes=st.lists(st.integers(-4000, 4000), max_size=40))
def test_number_range_allows_only_numbers_within(
    lo: float | None, lo_x: bool, hi: float | None, hi_x: bool, probes: list[int]
) -> None:
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    try:
        r = _regex(number_range(lo, lo_x, hi, hi_x))
    except ValueError:
        return  # too narrow: refused by the schema check
    for text in [str(p / 100) for p in probes] + [str(p) for p in range(-40, 41)] + ["0.5", "0.05", "-0.5"]:
        if r.fullmatch(text):
            x = float(text)
            assert lo is None or (x > lo if lo_x else x >= lo), (lo, lo_x, text)
            assert hi is None or (x < hi if hi_x else x <= hi), (hi, hi_x, text)


async def test_schemas_are_converted_off_the_event_loop(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A schema's conversion runs on a worker thread (``Inputs.generation_params_off_loop``):
    however long it takes, it cannot hold the trio thread and the streams it serves."""
    import threading

    from hydra_trio.engine.chat import grammar

    seen: list[threading.Thread] = []
    real = grammar.convert_schema

    def spy(text: str) -> str:
        seen.append(threading.current_thread())
        return real(text)

    monkeypatch.setattr(grammar, "convert_schema", spy)
    grammar._schema_gbnf.cache_clear()
    async with http(engine) as h:
        schema = {"type": "object", "properties": {"q": {"type": "integer", "minimum": 3, "maximum": 77}}, "required": ["q"]}
        body = await chat(h, json_schema=schema, max_tokens=64)
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)
    loop_thread = threading.current_thread()  # this test runs on the engine's trio thread
    assert seen and all(t is not loop_thread for t in seen), seen
