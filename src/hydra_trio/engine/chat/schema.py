"""JSON schemas, checked before any grammar text is built: what the converter
(``llama/schema.py``) enforces passes, normalised; what no value can satisfy is a 400 saying
so; what cannot be enforced is a 400 naming the keyword; and every count that sizes the
grammar (lengths, item counts, a pattern's repetitions, the schema's nodes) is bounded
here, so a 60-byte schema cannot make the converter build megabytes (``minLength: 1e8``).
Pure Python, linear in the schema's size.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ...wire.errors import ProtocolError, bad_param
from ..llama import int_bounds, number_bounds, number_range

# llama.cpp refuses a repetition over 2000 ("exceeds sane defaults"): refused here first,
# before the converter writes anything.
MAX_REPEAT = 2000
MAX_REPEAT_TOTAL = 16384  # all counts of one schema together: what llama.cpp expands
MAX_NODES = 4096  # subschemas of one schema
MAX_ENUM = 1024  # enum values of one schema together

# Keywords that assert what a context-free grammar of the reply cannot (or the converter
# does not) enforce: refused, since a reply would then not be valid for the schema.
# Annotations (title, description, default, examples, ...) constrain nothing and pass.
UNENFORCED = frozenset({
    "multipleOf", "uniqueItems", "minProperties", "maxProperties", "patternProperties", "propertyNames",
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
    "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems", "additionalItems",
})
_ENFORCED_FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5", "email", "uri", "ipv4"})
_TYPES = frozenset({"string", "integer", "number", "boolean", "null", "object", "array"})
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems")
_QUANTIFIER = re.compile(r"\{(\d*)(?:,(\d*))?\}")


def check_schema(schema: Any, param: str, *, relax_unenforced: bool = False) -> Any:
    """``schema`` normalised for the converter, or a 400 naming ``param`` and the problem.

    ``relax_unenforced``: a keyword in UNENFORCED is left out (the grammar then allows more
    than the schema) instead of refused. For a tool's parameters: an agent's whole tool list
    must not be refused for one ``propertyNames`` (Claude Code sends one), and a tool call's
    arguments are the client's to check; ``response_format`` keeps the refusal."""
    if not isinstance(schema, dict | bool):
        raise bad_param(f"{param} must be a JSON schema (an object)", param)
    if schema is False:
        raise _unsatisfiable(param, "the schema is false")
    walk = _Walk(param, relax_unenforced)
    try:
        return walk.node(schema, "")
    except RecursionError:
        raise bad_param(f"{param}: schema nested too deeply", param) from None


def _unsatisfiable(param: str, why: str) -> ProtocolError:
    return bad_param(f"{param}: no value can satisfy the schema ({why})", param)


class _Walk:
    def __init__(self, param: str, relax_unenforced: bool = False) -> None:
        self.param = param
        self.relax_unenforced = relax_unenforced
        self.nodes = 0
        self.repeats = 0
        self.enums = 0

    def fail(self, where: str, message: str) -> ProtocolError:
        at = f" at {where}" if where else ""
        return bad_param(f"{self.param}{at}: {message}", self.param)

    def unsat(self, where: str, why: str) -> ProtocolError:
        at = f" at {where}" if where else ""
        return bad_param(f"{self.param}{at}: no value can satisfy the schema ({why})", self.param)

    def count(self, where: str, key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or not math.isfinite(value) or value != int(value):
            raise self.fail(where, f"{key} must be a non-negative integer")
        n = int(value)
        if n > MAX_REPEAT:
            raise self.fail(where, f"the schema's grammar is too large: {key} {n} is over {MAX_REPEAT}")
        self.repeats += n
        if self.repeats > MAX_REPEAT_TOTAL:
            raise self.fail(where, f"the schema's grammar is too large: its lengths and item counts add up to over {MAX_REPEAT_TOTAL}")
        return n

    def node(self, schema: Any, where: str) -> Any:
        if isinstance(schema, bool):
            return {} if schema else {"not": {}}  # false: only where no value is asked (checked by the caller)
        if not isinstance(schema, dict):
            raise self.fail(where, "a subschema must be an object or a boolean")
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise self.fail(where, f"the schema's grammar is too large: over {MAX_NODES} subschemas")
        out = dict(schema)
        bad = sorted(UNENFORCED.intersection(out))
        if bad and not self.relax_unenforced:
            raise self.fail(where, f"the schema keyword {bad[0]!r} is not supported in constrained output")
        for key in bad:
            del out[key]
        if out.get("nullable") is True:  # OpenAPI's spelling of "or null"
            out.pop("nullable")
            return self.node({"anyOf": [out, {"type": "null"}]}, where)
        out.pop("nullable", None)
        kind = out.get("type")
        if isinstance(kind, list):
            if not kind or not all(isinstance(t, str) and t in _TYPES for t in kind):
                raise self.fail(where, f"type must be one of {', '.join(sorted(_TYPES))} or a non-empty list of them")
            if len(kind) == 1:
                out["type"] = kind[0]
            else:
                rest = {k: v for k, v in out.items() if k != "type"}
                return self.node({"anyOf": [{**rest, "type": t} for t in dict.fromkeys(kind)]}, where)
        elif kind is not None and kind not in _TYPES:
            raise self.fail(where, f"Unrecognized schema: type {kind!r}")
        if "allOf" in out:
            out = self.all_of(out, where)
            kind = out.get("type")
        for key in ("$defs", "definitions", "properties"):
            if isinstance(out.get(key), dict):
                out[key] = {k: self.node(v, f"{where}/{key}/{k}") for k, v in out[key].items()}
        for key in ("anyOf", "oneOf", "prefixItems"):
            if key in out:
                if not isinstance(out[key], list) or not out[key]:
                    raise self.fail(where, f"{key} must be a non-empty array of schemas")
                out[key] = [self.node(v, f"{where}/{key}/{i}") for i, v in enumerate(out[key])]
        if isinstance(out.get("items"), dict | bool):
            if out["items"] is False:
                out["maxItems"] = 0
                out.pop("items")
            else:
                out["items"] = self.node(out["items"], f"{where}/items")
        elif isinstance(out.get("items"), list):  # draft-4 tuples
            out["items"] = [self.node(v, f"{where}/items/{i}") for i, v in enumerate(out["items"])]
        if isinstance(out.get("additionalProperties"), dict):
            out["additionalProperties"] = self.node(out["additionalProperties"], f"{where}/additionalProperties")
        self.values(out, kind, where)
        self.strings(out, kind, where)
        self.numbers(out, kind, where)
        self.objects(out, kind, where)
        for lo_key, hi_key in (("minLength", "maxLength"), ("minItems", "maxItems")):
            lo = self.count(where, lo_key, out[lo_key]) if lo_key in out else 0
            hi = self.count(where, hi_key, out[hi_key]) if hi_key in out else None
            if hi is not None and lo > hi:
                raise self.unsat(where, f"{lo_key} {lo} is over {hi_key} {hi}")
        return out

    def all_of(self, out: dict[str, Any], where: str) -> dict[str, Any]:
        parts = out.get("allOf")
        if not isinstance(parts, list) or not parts:
            raise self.fail(where, "allOf must be a non-empty array of schemas")
        types = {t for p in parts if isinstance(p, dict) and isinstance(t := p.get("type"), str)}
        if out.get("type") is not None:
            types.add(out["type"])
        if len(types - {"integer", "number"}) + (1 if types & {"integer", "number"} else 0) > 1:
            raise self.unsat(where, f"allOf asks for a value of types {', '.join(sorted(types))} at once")
        if len(parts) == 1 and isinstance(parts[0], dict):
            # pydantic's {"allOf": [{"$ref": ...}], "description": ...}: the one part, annotated.
            rest = {k: v for k, v in out.items() if k != "allOf"}
            asserting = {k for k in rest if k not in ("title", "description", "default", "examples", "$comment")}
            if not asserting:
                return self.node(parts[0], f"{where}/allOf/0")
        if all(isinstance(p, dict) and (p.get("type") == "object" or "properties" in p or "$ref" in p) for p in parts):
            out["allOf"] = [self.node(p, f"{where}/allOf/{i}") for i, p in enumerate(parts)]
            return out  # objects: the converter merges their properties
        raise self.fail(where, "allOf of schemas that are not objects is not supported in constrained output")

    def values(self, out: dict[str, Any], kind: Any, where: str) -> None:
        if "enum" in out:
            if not isinstance(out["enum"], list):
                raise self.fail(where, "enum must be an array")
            kept = [v for v in out["enum"] if _is_type(v, kind)]
            if not kept:
                raise self.unsat(where, "no enum value is of the schema's type" if out["enum"] else "enum is empty")
            self.enums += len(kept)
            if self.enums > MAX_ENUM:
                raise self.fail(where, f"the schema's grammar is too large: over {MAX_ENUM} enum values")
            out["enum"] = kept
        if "const" in out and not _is_type(out["const"], kind):
            raise self.unsat(where, "const is not of the schema's type")

    def strings(self, out: dict[str, Any], kind: Any, where: str) -> None:
        fmt = out.get("format")
        if fmt is not None and not isinstance(fmt, str):
            raise self.fail(where, "format must be a string")
        if fmt not in _ENFORCED_FORMATS:
            out.pop("format", None)  # an annotation (draft 2020-12's default): not asserted
            fmt = None
        pattern = out.get("pattern")
        if pattern is None:
            if fmt is not None and any(k in out for k in ("minLength", "maxLength")):
                raise self.fail(where, f"format {fmt!r} with minLength or maxLength is not supported in constrained output")
            return
        if not isinstance(pattern, str):
            raise self.fail(where, "pattern must be a string")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise self.unsat(where, f"pattern {pattern!r} is not a valid regular expression: {exc}") from None
        if fmt is not None or any(k in out for k in ("minLength", "maxLength")):
            raise self.fail(where, "pattern with format, minLength or maxLength is not supported in constrained output")
        for m in _QUANTIFIER.finditer(pattern):
            for n in m.groups():
                if n:
                    self.count(where, "a pattern's repetition", int(n))
        out["pattern"] = _anchored(pattern)

    def numbers(self, out: dict[str, Any], kind: Any, where: str) -> None:
        keys = [k for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in out]
        if not keys:
            return
        for k in keys:
            v = out[k]
            if isinstance(v, bool) and k.startswith("exclusive"):
                continue  # draft 4
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise self.fail(where, f"{k} must be a number")
        if kind == "integer":
            lo, hi = int_bounds(out)
            if lo is not None and hi is not None and lo > hi:
                raise self.unsat(where, "no integer lies within its bounds")
        elif kind == "number":
            lo_f, lo_x, hi_f, hi_x = number_bounds(out)
            if lo_f is not None and hi_f is not None and (lo_f > hi_f or (lo_f == hi_f and (lo_x or hi_x))):
                raise self.unsat(where, "no number lies within its bounds")
            try:
                number_range(lo_f, lo_x, hi_f, hi_x)
            except ValueError:
                # Neither an integer nor a whole unit between two fits (0.1 to 0.9): the
                # grammar's exponent-free decimals could not be kept within it.
                raise self.fail(where, "a number range narrower than a unit between integers is not supported in constrained output") from None

    def objects(self, out: dict[str, Any], kind: Any, where: str) -> None:
        required = out.get("required")
        if required is None:
            return
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise self.fail(where, "required must be an array of property names")
        props = out.get("properties") if isinstance(out.get("properties"), dict) else {}
        missing = [r for r in required if r not in props]
        if missing and out.get("additionalProperties") is False:
            raise self.unsat(where, f"{missing[0]!r} is required but additionalProperties is false and it is not a property")
        for r in required:
            if isinstance(props.get(r), dict) and props[r] == {"not": {}}:
                raise self.unsat(where, f"{r!r} is required but its schema is false")
        if missing:
            # The converter writes only declared properties: a required one it does not know
            # is declared as any value, so the reply holds it.
            extra = out.get("additionalProperties")
            any_value = extra if isinstance(extra, dict) else {}
            out["properties"] = {**props, **{m: any_value for m in missing}}


def _is_type(value: Any, kind: Any) -> bool:
    if kind is None:
        return True
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())
    return {
        "string": isinstance(value, str),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
    }.get(kind, True)


def _anchored(pattern: str) -> str:
    """JSON Schema's pattern matches anywhere in the string; the converter's spells the whole
    string (``^...$``): an open side gets ``.*``. Shorthand classes the converter does not
    know become ranges inside a JSON string (``\\s``: a space, as raw tabs and newlines are
    not JSON), and negated classes leave out what would end or break the string."""
    body = pattern[1:] if pattern.startswith("^") else ".*(" + pattern
    if pattern.startswith("^"):
        body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body + ".*"
    else:
        body = (body[:-1] + ")" if body.endswith("$") and not body.endswith("\\$") else body + ").*")
    return "^" + _json_classes(body) + "$"


_SHORT = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " "}
_NOT_IN_STRING = '"\\\\\\x00-\\x1F\\x7F'  # regex text: quote, backslash, control characters


def _json_classes(body: str) -> str:
    out: list[str] = []
    i, n, in_class = 0, len(body), False
    while i < n:
        c = body[i]
        if c == "\\" and i + 1 < n:
            e = body[i + 1]
            if e in _SHORT:
                out.append(_SHORT[e] if in_class else f"[{_SHORT[e]}]")
            elif e.lower() in _SHORT and not in_class:
                out.append(f"[^{_SHORT[e.lower()]}{_NOT_IN_STRING}]")
            else:
                out.append(body[i:i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            if body.startswith("[^", i):
                out.append("[^" + _NOT_IN_STRING)
                i += 2
                continue
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)
