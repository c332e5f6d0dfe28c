"""The schema keywords agents and pydantic/zod send (issues 40, 49): each is enforced by the
grammar (llguidance's JSON compiler), so every reply on the random-weight tiny model validates
(``jsonschema``, formats checked); a schema no value can satisfy is a 400 saying so; what
cannot be enforced is relaxed (tools, and schemas without ``strict``) or refused naming the
keyword (``strict``), by the one schema policy (engine/structured/schema_policy.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from llguidance import LLMatcher

from helpers import assert_server_healthy, chat, http
from hydra_trio.engine.structured import prepare_schema
from hydra_trio.engine.structured.schema_policy import DATED_PATTERNS
from hydra_trio.wire import ProtocolError

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
    "date_time_and_pattern": {"type": "string", "format": "date-time", "pattern": "^20"},
    "uuid": {"type": "string", "format": "uuid"},
    "email": {"type": "string", "format": "email", "maxLength": 24},  # a format with a length (refused before)
    "ipv4": {"type": "string", "format": "ipv4"},
    "string_lengths": {"type": "string", "minLength": 2, "maxLength": 5},
    "items_counts": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
                     "maxItems": 4},
    "const": {"const": "fixed"},
    "enum": {"enum": ["red", "green", 3, None]},
    "ref_defs": {
        "$defs": {
            "Point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
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
        ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength (5) is greater than maxLength (2)"),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems (3) is greater than maxItems (1)"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "incompatible types"),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": False}, "'b'"),
        ({"type": "integer", "minimum": 3, "maximum": 2}, "minimum (3) is greater than maximum (2)"),
        ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}, "no integer values"),
        ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "exclusiveMinimum (1) is equal to maximum (1)"),
        ({"type": "string", "enum": [1, 2]}, "incompatible types"),
        ({"enum": []}, "empty"),
        ({"type": "integer", "const": "x"}, "incompatible types"),
    ],
)
async def test_unsatisfiable_schemas_are_400(engine: Any, schema: dict[str, Any], says: str) -> None:
    async with http(engine) as h:
        for strict in (False, True):  # relaxed or not, no reply could follow it
            body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
            if strict:
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema, "strict": True},
                }
            else:
                body["json_schema"] = schema
            r = await h.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"].startswith("response_format" if strict else "json_schema"), err
            assert "no value can satisfy the schema" in err["message"] and says in err["message"], err
            assert not re.search(r"\d\d:\d\d:\d\d", err["message"]), err  # the problem, never a log line
    await assert_server_healthy(engine)


# A bound llguidance's number reader cannot hold (issue 50: a 500 OverflowError before), a
# keyword it does not implement, a pattern with look-around, an unknown format.
UNENFORCEABLE: dict[str, tuple[dict[str, Any], str]] = {
    "huge_bound": ({"type": "integer", "minimum": int("9" * 400)}, "minimum"),
    "huge_max_length": ({"type": "string", "maxLength": int("9" * 400)}, "maxLength"),
    "not": ({"type": "string", "not": {"const": "x"}}, "not"),
    "unique_items": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    "lookaround": ({"type": "string", "pattern": "^(?!x)[a-z]+$"}, "pattern"),
    "unknown_format": ({"type": "string", "format": "my-format"}, "format"),
    # What llguidance cannot compile at all (SchemaStore has both): the whole schema but its
    # type is relaxed, the error named.
    "dangling_ref": ({"type": "object", "properties": {"a": {"$ref": "#/definitions/gone"}}}, "does not exist"),
}


@pytest.mark.parametrize("case", sorted(UNENFORCEABLE))
async def test_unenforceable_keywords_are_relaxed_unless_strict(
    engine: Any, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    schema, keyword = UNENFORCEABLE[case]
    wrapped = {"type": "object", "properties": {"v": schema}, "required": ["v"], "additionalProperties": False}
    async with http(engine) as h:
        strict = {"type": "json_schema", "json_schema": {"name": "x", "schema": wrapped, "strict": True}}
        r = await h.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "response_format": strict}
        )
        assert r.status_code == 400, r.text
        assert keyword in r.json()["error"]["message"], r.json()
        caplog.clear()
        with caplog.at_level("INFO", logger="hydra_trio.structured"):
            loose = {"type": "json_schema", "json_schema": {"name": "x", "schema": wrapped}}
            body = await chat(h, response_format=loose, max_tokens=48)
            tool = {"type": "function", "function": {"name": "f", "parameters": wrapped}}
            called = await chat(h, tools=[tool], tool_choice="required", max_tokens=48)
        assert body["choices"][0]["message"]["content"].startswith("{")
        assert called["choices"][0]["message"].get("tool_calls") or called["choices"][0]["finish_reason"] == "length", (
            called
        )
        said = [r.getMessage() for r in caplog.records if "relaxed" in r.getMessage()]
        assert any(keyword in m for m in said), said  # one line names what was left out
    await assert_server_healthy(engine)


def test_the_policy_leaves_annotations_out_and_keeps_every_constraint() -> None:
    """A grammar is keyed by what it enforces: descriptions and titles never reach it (a tool
    list whose descriptions change compiles once); property names that look like annotations
    stay, and so does every constraint."""
    schema = {
        "type": "object",
        "title": "T",
        "description": "what it is",
        "properties": {"description": {"type": "string", "description": "a property named description",
                                       "maxLength": 9}},
        "required": ["description"],
        "x-vendor": 1,
        "$defs": {"D": {"type": "integer", "examples": [1], "minimum": 0}},
    }
    out = prepare_schema(schema, "tools[0].function.parameters", strict=False).schema
    assert out == {
        "type": "object",
        "properties": {"description": {"type": "string", "maxLength": 9}},
        "required": ["description"],
        "additionalProperties": False,  # the listed properties only, as llama.cpp writes an object
        "$defs": {"D": {"type": "integer", "minimum": 0, "maximum": 2**53 - 1}},  # numbers I-JSON's: closed
    }
    # A call's arguments sit inside the call's object: their references follow them there.
    refs = prepare_schema(
        {"properties": {"p": {"$ref": "#/$defs/D"}, "me": {"$ref": "#"}}}, "x", strict=False, ref_base="#/a"
    )
    assert refs.schema["properties"] == {"p": {"$ref": "#/a/$defs/D"}, "me": {"$ref": "#/a"}}
    with pytest.raises(ProtocolError, match="nests subschemas more than"):
        deep: dict[str, Any] = {"type": "string"}
        for _ in range(100):
            deep = {"anyOf": [deep]}
        prepare_schema(deep, "json_schema", strict=False)
    with pytest.raises(ProtocolError, match="must be a JSON schema"):
        prepare_schema([1], "json_schema", strict=False)


async def test_grammars_are_written_and_compiled_off_the_event_loop(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schema's policy walk and its compile run on worker threads: however long they take,
    they cannot hold the trio thread and the streams it serves."""
    import threading

    from hydra_trio.engine.structured import grammars, guidance

    seen: list[tuple[str, threading.Thread]] = []
    real_prepare, real_compile = grammars.prepare_schema, guidance.GuidanceCache.compile

    def spy_prepare(*args: Any, **kwargs: Any) -> Any:
        seen.append(("prepare", threading.current_thread()))
        return real_prepare(*args, **kwargs)

    def spy_compile(self: Any, grammar: Any) -> None:
        seen.append(("compile", threading.current_thread()))
        real_compile(self, grammar)

    monkeypatch.setattr(grammars, "prepare_schema", spy_prepare)
    monkeypatch.setattr(guidance.GuidanceCache, "compile", spy_compile)
    async with http(engine) as h:
        schema = {
            "type": "object",
            "properties": {"q": {"type": "integer", "minimum": 3, "maximum": 77}},
            "required": ["q"],
            "additionalProperties": False,
        }
        body = await chat(h, json_schema=schema, max_tokens=64)
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)
    loop_thread = threading.current_thread()  # this test runs on the engine's trio thread
    assert {what for what, _ in seen} == {"prepare", "compile"}
    assert all(t is not loop_thread for _, t in seen), seen


def test_the_date_patterns_admit_exactly_the_dates_python_reads() -> None:
    """Every day of years 0000-9999 (leap days, month ends, year zero): the engine's date
    pattern matches it exactly when Python's date reads it; times keep at most nanoseconds."""
    import datetime

    date = re.compile(DATED_PATTERNS["date"])
    for year in range(10000):
        for month in range(1, 13):
            for day in (1, 28, 29, 30, 31):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    datetime.date.fromisoformat(text)
                    readable = True
                except ValueError:
                    readable = False
                assert bool(date.match(text)) == readable, text
    stamp = re.compile(DATED_PATTERNS["date-time"])
    assert stamp.match("2024-02-29T23:59:59.123456789Z") and stamp.match("0001-01-01T00:00:00+05:30")
    assert not stamp.match("2023-02-29T00:00:00Z") and not stamp.match("2024-01-01T00:00:00.1234567890Z")


def test_objects_are_closed_as_llama_cpp_writes_them_unless_composed() -> None:
    """An object listing its properties gets only those (a base model added keys to its cap);
    where subschemas list one object's properties between them (allOf, alternatives beside
    other keywords, a $ref an allOf composes), none is closed alone: that would leave no value
    (SchemaStore's bootstraprc and debugsettings were refused so). Object and array keywords
    without a type give that type."""

    def policy(schema: dict[str, Any]) -> dict[str, Any]:
        return prepare_schema(schema, "json_schema", strict=False).schema

    assert policy({"type": "object", "properties": {"a": {}}})["additionalProperties"] is False
    assert "additionalProperties" not in policy({"type": "object", "properties": {"a": {}}, "required": ["b"]})
    assert (
        policy({"type": "object", "properties": {"a": {}}, "additionalProperties": True})["additionalProperties"]
        is True
    )
    composed = policy({
        "definitions": {"core": {"properties": {"name": {"type": "string"}}}},
        "required": ["name", "x"],
        "allOf": [{"$ref": "#/definitions/core"}, {"anyOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]}],
    })
    assert "additionalProperties" not in composed["definitions"]["core"]
    assert all("additionalProperties" not in alt for alt in composed["allOf"][1]["anyOf"])
    beside = policy({"required": ["name"], "anyOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in alt for alt in beside["anyOf"])
    alone = policy({"anyOf": [{"properties": {"a": {}}}, {"type": "string"}]})
    assert alone["anyOf"][0] == {"properties": {"a": {}}, "type": "object", "additionalProperties": False}
    assert policy({"properties": {"a": {}}})["type"] == "object"
    assert policy({"items": {"type": "integer", "minimum": 0, "maximum": 9}})["type"] == "array"
    for schema in (composed, beside):  # each still has a value
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema))
        assert not LLMatcher.validate_grammar_with_warnings(grammar)[0]


def test_a_panic_inside_llguidance_is_a_refusal_not_a_500() -> None:
    """llguidance panicked formatting an error cut inside a multi-byte character (pyo3's
    PanicException, a BaseException: 5 of 25,000 fuzzed bodies were 500s); a call on a
    client's text turns one into a ValueError, which the policy relaxes or refuses."""
    from hydra_trio.engine.structured.schema_policy import checked

    class PanicException(BaseException):  # pyo3_runtime's, by name
        pass

    def panics() -> None:
        raise PanicException("end byte index 100 is not a char boundary")

    with pytest.raises(ValueError, match="llguidance could not read it"):
        checked(panics)
    with pytest.raises(KeyboardInterrupt):  # anything else goes on as it was
        checked(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert checked(lambda: 7) == 7
