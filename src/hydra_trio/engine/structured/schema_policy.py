"""JSON schemas as clients send them, made ready for llguidance's JSON compiler: the one
policy of what is enforced, what is relaxed and what is refused (docs/http-api.md,
"Structured output").

- Annotations (``description``, ``title``, ``examples``, ``default``, ``$comment``, vendor
  ``x-`` keys, ...) are dropped from the grammar's copy: they constrain nothing, and without
  them a compiled grammar is keyed by what it depends on (a tool list whose descriptions change
  between turns compiles once).
- Every other keyword llguidance implements is enforced. A keyword it cannot enforce is
  *relaxed* (left out, named in the log) for tool parameters and for schemas sent without
  ``strict``: an agent's whole tool list is never refused for one keyword in one tool. With
  ``strict: true`` (OpenAI's structured outputs) it is a 400 naming it, as OpenAI answers.
- A schema no value satisfies (``minLength`` above ``maxLength``, ``false``, an ``enum`` of
  none) is a 400 in every use: no reply could follow it.

llguidance drops the keywords it does not implement (``if``, ``not``, ``uniqueItems``, ...)
itself in its lenient mode; what it cannot drop (a ``pattern`` with look-around, a bound past
its number range, an unknown ``format``, an external ``$ref``, a ``type`` that is no JSON type)
is found here, each value checked alone once (``_compiles``, cached), and left out.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeVar

from llguidance import LLMatcher

from ...wire.errors import bad_param

# Keys that describe a schema without constraining it: left out of the grammar's copy.
ANNOTATIONS = frozenset({
    "description", "title", "examples", "example", "default", "$comment", "deprecated", "readOnly",
    "writeOnly", "markdownDescription", "markdownEnumDescriptions", "enumDescriptions", "$schema",
    "x-guidance",  # llguidance's own options are the engine's (WHITESPACE, lenient), never a client's
})
# Keywords whose value is a subschema, a map of subschemas, or a list of subschemas.
_ONE = frozenset({
    "items", "additionalProperties", "unevaluatedProperties", "not", "if", "then", "else", "contains",
    "propertyNames", "additionalItems", "unevaluatedItems",
})
_MAP = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_LIST = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
# Keywords whose value llguidance may fail on by itself: each checked alone, under the type it
# applies to, and left out (relaxed) when it does not compile.
_CHECKED: dict[str, str | None] = {
    "pattern": "string", "format": "string", "minLength": "string", "maxLength": "string",
    "minimum": "number", "maximum": "number", "exclusiveMinimum": "number", "exclusiveMaximum": "number",
    "multipleOf": "number", "minItems": "array", "maxItems": "array", "minProperties": "object",
    "maxProperties": "object", "type": None, "enum": None, "const": None,
}
_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
# Dates and times the engine writes are ones its client can read back: llguidance's formats
# admit year 0000 (no year to Python's date, nor to jsonschema's and pydantic's validators),
# February 29th of any year, and a fraction of a second without end (a base model writes zeros
# until its length cap). These patterns replace the format: years 0001-9999, leap days in leap
# years, at most nanoseconds. (A pattern is a search in llguidance: anchored here.)
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
DATED_PATTERNS = {"date": f"^{_DATE}$", "date-time": f"^{_DATE}T{_TIME}$", "time": f"^{_TIME}$"}
# Numbers the engine writes are I-JSON's (RFC 7493): without a bound, JSON's number grammar
# admits 0.2e12002, which every JSON reader turns into infinity (and a call's arguments then
# cannot be read). A side the schema leaves open is closed at the largest integer any
# reader keeps exactly; any bound at all also leaves exponents out of llguidance's grammar.
I_JSON_LIMIT = 2**53 - 1
# And a number's fraction is at most this fine (JSON allows digits without end: a model could
# write zeros until its length cap; llama.cpp's converter allows 16, llguidance reads a finer
# multipleOf than 1e-10 as a double's rounding error).
FRACTION_STEP = 1e-10
_LOWER = ("minimum", "exclusiveMinimum")
_UPPER = ("maximum", "exclusiveMaximum")
# An object that lists its properties and says nothing of others gets only those, as llama.cpp's
# converter writes it (llguidance, by the letter of JSON Schema, lets a model add keys: a base
# model wrote them until its length cap). Not where subschemas list one object's properties
# between them: an allOf's members, alternatives beside listed properties or a $ref, an object
# with any of those (``_composes``); nor one that requires a property it does not list.
_OPEN_OBJECT = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref")
MAX_SCHEMA_DEPTH = 64
# A pattern's counted repetition is compiled into llguidance's lexer: ``a{1000}`` costs it 28 ms
# a token, ``a{100000}`` 1.4 s (measured, the tiny model's vocabulary): a count past this is
# one the engine cannot enforce within its per-token bound.
MAX_PATTERN_COUNT = 1000
_COUNTS = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")
# A minimum size no reply can reach (minLength 1e8 characters): no value satisfies it here.
MAX_MINIMUM_SIZE = 1 << 20
# nested subschemas: deeper than any real schema, bounded for the walk
_MINIMUMS = ("minLength", "minItems", "minProperties")
# JSON whitespace between tokens, as llama.cpp's converter bounds it (a base model asked for
# JSON may otherwise write whitespace until its length cap).
WHITESPACE = "(?: |\\n{1,2}[ \\t]{0,20})?"


@dataclass(frozen=True, slots=True)
class PreparedSchema:
    """A client's schema as the grammar holds it, and what was left out of it (the log names
    each: ``where: keyword (why)``)."""

    schema: dict[str, Any]
    relaxed: tuple[str, ...]


def schema_json(schema: dict[str, Any], *, strict: bool) -> str:
    """A prepared schema with the engine's llguidance options, as ``%json`` takes it."""
    options = {"whitespace_pattern": WHITESPACE, "lenient": not strict}
    return json.dumps({**schema, "x-guidance": options}, ensure_ascii=False, separators=(",", ":"))


def prepare_schema(schema: Any, param: str, *, strict: bool, ref_base: str = "#") -> PreparedSchema:
    """``schema`` (an object or a boolean) as the grammar enforces it: annotations left out,
    and (unless ``strict``) every value llguidance cannot compile relaxed; a 400 naming
    ``param`` for a value that is no schema at all, or nesting past MAX_SCHEMA_DEPTH.
    ``ref_base``: where the schema's root will sit in the document the grammar compiles (its
    local ``$ref``s are pointed there: a call's arguments inside the call's object)."""
    if isinstance(schema, bool):
        if not schema:
            raise bad_param(f"{param}: the schema is false: no value satisfies it", param)
        return PreparedSchema({}, ())
    if not isinstance(schema, dict):
        raise bad_param(f"{param} must be a JSON schema (an object or a boolean)", param)
    relaxed: list[str] = []
    composed: set[str] = set()
    _composed_refs(schema, False, composed, 0)
    out = _walk(schema, "", _Walk(relaxed, strict, param, ref_base, frozenset(composed)), 0)
    return PreparedSchema(out, tuple(relaxed))


@dataclass(frozen=True, slots=True)
class _Walk:
    relaxed: list[str]
    strict: bool
    param: str
    ref_base: str
    composed_refs: frozenset[str]  # definitions an allOf composes with others (never closed)


# A schema without a type keeps it open where something else says what the value is.
_UNTYPED_KEEPS = ("$ref", "enum", "const", "anyOf", "oneOf", "allOf", "not", "if")
# What a schema may hold beside its alternatives and still leave each alternative the whole
# description of its value (anything else, e.g. ``required`` or ``allOf``, composes with them).
_ALTERNATIVES_ONLY = frozenset({"anyOf", "oneOf", "type", "$defs", "definitions", "$schema", "$id", "id"}) | ANNOTATIONS
# Keywords whose subschemas describe the same value as the schema holding them.
_SAME_VALUE = frozenset({"allOf", "anyOf", "oneOf", "if", "then", "else"})


def _composes(node: dict[str, Any], key: str, composed: bool) -> bool:
    """Whether ``node[key]``'s subschemas list their value's properties together with others
    (an allOf's members; alternatives beside other keywords of their object, such as listed
    properties, ``required`` or a $ref; anything within such a member)."""
    return key in _SAME_VALUE and (composed or key == "allOf" or any(k not in _ALTERNATIVES_ONLY for k in node))


def _composed_refs(node: Any, composed: bool, out: set[str], depth: int) -> None:
    """The local ``$ref`` targets (as ``/definitions/X``) that an allOf member reaches for its
    value: an allOf's members list one object's properties between them, so none of them
    may be closed on its own."""
    if depth > MAX_SCHEMA_DEPTH or not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if composed and isinstance(ref, str) and ref.startswith("#"):
        out.add(ref[1:])
    for key, value in node.items():
        if key in _SAME_VALUE:
            for child in value if isinstance(value, list) else [value]:
                _composed_refs(child, _composes(node, key, composed), out, depth + 1)
        elif key in _ONE:
            _composed_refs(value, False, out, depth + 1)
        elif key in _MAP and isinstance(value, dict):
            for child in value.values():
                _composed_refs(child, False, out, depth + 1)
        elif key == "prefixItems" and isinstance(value, list):
            for child in value:
                _composed_refs(child, False, out, depth + 1)


def _walk(node: Any, where: str, w: _Walk, depth: int, composed: bool = False) -> Any:
    """``composed``: the node describes its value together with others (an allOf's member, or
    what such a member reaches for the same value): its object is not closed."""
    if depth > MAX_SCHEMA_DEPTH:
        raise bad_param(f"{w.param}: the schema nests subschemas more than {MAX_SCHEMA_DEPTH} deep", w.param)
    if not isinstance(node, dict):
        return node  # a boolean subschema, or a malformed one llguidance refuses (a 400)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ANNOTATIONS or key.startswith("x-"):
            continue
        at = f"{where}/{key}"
        same = _composes(node, key, composed)
        if key in _ONE:
            out[key] = _walk(value, at, w, depth + 1, same)
        elif key in _MAP and isinstance(value, dict):
            out[key] = {
                k: _walk(v, f"{at}/{k}", w, depth + 1, f"{at}/{k}" in w.composed_refs) for k, v in value.items()
            }
        elif key in _LIST and isinstance(value, list):
            out[key] = [_walk(v, f"{at}/{i}", w, depth + 1, same) for i, v in enumerate(value)]
        elif key == "$ref" and isinstance(value, str):
            if value.startswith("#"):
                out[key] = w.ref_base + value[1:]
            elif w.strict:
                raise bad_param(f"{w.param} at {where or '/'}: $ref {value!r} is not in the schema (only local "
                                "references resolve)", w.param)
            else:
                w.relaxed.append(f"{at} (a reference outside the schema)")
        elif key in _MINIMUMS and isinstance(value, int) and value > MAX_MINIMUM_SIZE:
            raise bad_param(f"{w.param} at {at}: no value can satisfy "
                            f"the schema within a reply: {key} {value}", w.param)
        elif key in _CHECKED and (why := _unenforceable(key, value)) is not None:
            if w.strict:
                raise bad_param(f"{w.param} at {at}: {key} cannot be enforced "
                                f"({why}); without strict it is relaxed", w.param)
            w.relaxed.append(f"{at} ({why})")
        else:
            out[key] = value
    if "type" not in out and not composed and not any(k in out for k in _UNTYPED_KEEPS):
        # Object or array keywords without a type: llama.cpp's converter writes that kind only
        # (by the letter of JSON Schema any other value passes: a base model wrote a number
        # of digits to its cap under SchemaStore's commitlintrc).
        if any(k in out for k in ("properties", "required", "additionalProperties")):
            out["type"] = "object"
        elif any(k in out for k in ("items", "prefixItems")):
            out["type"] = "array"
    listed = out.get("properties")
    required = out.get("required")
    names_all = not isinstance(required, list) or (
        isinstance(listed, dict) and all(isinstance(r, str) and r in listed for r in required)
    )
    if isinstance(listed, dict) and names_all and not composed and not any(k in out for k in _OPEN_OBJECT):
        out["additionalProperties"] = False  # only the listed properties, as llama.cpp writes it
    fmt = out.get("format")
    if isinstance(fmt, str) and (dated := DATED_PATTERNS.get(fmt)) is not None:
        del out["format"]
        if "pattern" in out:  # the client's pattern and the date's, both
            out["allOf"] = [*out.get("allOf", []), {"pattern": dated}]
        else:
            out["pattern"] = dated
    kinds = out.get("type")
    if kinds in ("number", "integer") or (isinstance(kinds, list) and {"number", "integer"} & set(kinds)):
        if not any(k in out for k in _LOWER):
            out["minimum"] = -I_JSON_LIMIT
        if not any(k in out for k in _UPPER):
            out["maximum"] = I_JSON_LIMIT
        if "multipleOf" not in out and (kinds == "number" or (isinstance(kinds, list) and "number" in kinds)):
            out["multipleOf"] = FRACTION_STEP
    return out


T = TypeVar("T")


def checked(fn: Callable[[], T]) -> T:
    """``fn()``, a call into llguidance on a client's text, with a Rust panic in it (pyo3's
    PanicException: a BaseException, so no ``except Exception`` took it; the dialect fuzz found
    one formatting an error inside a multi-byte character) as a ValueError: a 400, not a 500."""
    try:
        return fn()
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise ValueError("llguidance could not read it "
                         f"({str(exc).splitlines()[0][:200] if str(exc) else 'a panic'})") from None


def validation_errors(grammar: str) -> tuple[bool, list[str]]:
    """llguidance's check of a grammar (a panic in it: an error)."""
    try:
        return checked(lambda: LLMatcher.validate_grammar_with_warnings(grammar))
    except ValueError as exc:
        return True, [str(exc)]


@lru_cache(maxsize=256)
def whole_schema_problem(expr: str) -> str | None:
    """Why llguidance cannot compile a prepared schema's expression at all (a reference it
    cannot resolve, a regex in a place the policy does not check, a recursion it does not
    take), None when it can, or when no value satisfies the schema (that stays the client's
    400). Cached: a client sends the same tools with every turn."""
    message = _first_problem(lambda: LLMatcher.grammar_from_lark("start: " + expr))
    return None if message is None or "Unsatisfiable" in message else message


def _first_problem(make: Callable[[], str]) -> str | None:
    """The first line of llguidance's error for the grammar ``make`` writes (None: it compiles)."""
    try:
        grammar = checked(make)
    except ValueError as exc:
        return str(exc)
    is_error, messages = validation_errors(grammar)
    if not is_error:
        return None
    return messages[0].strip().splitlines()[0] if messages and messages[0].strip() else "refused"


def open_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """What is left of a schema llguidance cannot compile: its value's type, if it says one."""
    kind = schema.get("type")
    return {"type": kind} if isinstance(kind, str) and kind in _TYPES else {}


def _unenforceable(key: str, value: Any) -> str | None:
    """Why llguidance cannot enforce ``key: value`` alone (None: it can)."""
    if key == "type":
        kinds = value if isinstance(value, list) else [value]
        if not all(isinstance(k, str) and k in _TYPES for k in kinds):
            return "not a JSON type"
        return None
    if not _json_numbers_fit(value):
        return "a number past the grammar's range"
    if key == "pattern" and isinstance(value, str) and any(
        int(n) > MAX_PATTERN_COUNT for m in _COUNTS.finditer(value) for n in m.groups() if n
    ):
        return f"a repetition count over {MAX_PATTERN_COUNT}: too large to enforce"
    text = json.dumps(value, sort_keys=True)
    return _compiles(key, text)


def _json_numbers_fit(value: Any) -> bool:
    """Whether every number in ``value`` is one llguidance's JSON reader takes (a double)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return True
    if isinstance(value, int):
        return abs(value) < 2**63
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_json_numbers_fit(v) for v in value)
    if isinstance(value, dict):
        return all(_json_numbers_fit(v) for v in value.values())
    return True


@lru_cache(maxsize=4096)
def _compiles(key: str, value_text: str) -> str | None:
    kind = _CHECKED[key]
    probe = {key: json.loads(value_text)} if kind is None else {"type": kind, key: json.loads(value_text)}
    message = _first_problem(lambda: LLMatcher.grammar_from_json_schema(json.dumps(probe)))
    # A value no string (number, ...) satisfies is the schema's to answer for, not a relaxation.
    return None if message is None or message.startswith("Unsatisfiable") else message
