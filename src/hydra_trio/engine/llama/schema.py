"""JSON schema -> GBNF: llama-cpp-python's converter (pure Python), extended with what it
leaves out and llama.cpp's C++ converter builds: integer and number bounds, the formats
email, uri and ipv4, and string lengths and item counts as GBNF repetitions (``x{m,n}``,
which llama.cpp expands on its own side: the converter's nested text grew with the count).

The schema reaching here was checked and normalised by ``engine/chat/schema.py`` (bounds
on every count, unsatisfiable schemas refused, ``nullable`` and type lists as ``anyOf``):
this module only writes the grammar.
"""

from __future__ import annotations

import json
import math
from typing import Any

from llama_cpp.llama_grammar import PRIMITIVE_RULES, SchemaConverter

# The converter's integers and numbers take at most 16 digits before the point: bounds
# beyond are clamped to it (every value the grammar allows is still within the schema's).
MAX_DIGITS = 16
MAX_MAGNITUDE = 10**MAX_DIGITS - 1
_FRACTION = '"." [0-9]{1,15}'

_CONVERTER_CHAR, _JSON_CHAR = r'char ::= [^"\\] |', r'char ::= [^"\\\x7F\x00-\x1F] |'
# A pattern's "." in a JSON string: no raw quote, backslash or control character (a quote
# would end the string early and the reply would not be JSON).
_CONVERTER_DOT, _JSON_DOT = r"dot ::= [^\x0A\x0D]", r'dot ::= [^"\\\x00-\x1F\x7F]'
# The converter's exponent takes 16 digits: 1e548 is JSON text, but no float (Python reads it
# as inf, strict JSON refuses it, and a tool call's arguments could not be written back).
# Two digits keep every number the grammar allows finite (16-digit mantissa, e99 at most).
_CONVERTER_EXP, _FINITE_EXP = "([eE] [-+]? integral-part)?", "([eE] [-+]? [0-9] [0-9]?)?"

_FORMATS = {
    # A subset of RFC 5322's addresses: what any checker accepts.
    # (Shorter than the RFCs allow: every value is still valid, and a model cannot run on.)
    "email": r'[a-zA-Z0-9._%+-]{1,32} "@" [a-zA-Z0-9-]{1,24} ("." [a-zA-Z0-9-]{1,24}){1,3}',
    "uri": r'[a-zA-Z] [a-zA-Z0-9+.-]{0,15} ":" [a-zA-Z0-9._~:/?#@!$&()*+,;=%-]{1,512}',
    "ipv4": "ipv4-octet " + " ".join(['"." ipv4-octet'] * 3),
}


# The converter's date takes year 0000 and September 31st: here only real dates (Feb 29th
# left out, years 1000-9999), so every date it allows is one a date parser accepts.
_DATE = (
    '[1-9] [0-9]{3} "-" (("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01])'
    ' | ("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30") | "02-" ("0" [1-9] | "1" [0-9] | "2" [0-8]))'
)


def convert_schema(schema_json: str) -> str:
    """A checked schema's text (chat/schema.py) as GBNF. Raises what the converter raises
    (assertions, KeyError, ValueError) for a schema it cannot express: the caller names it."""
    converter = _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    schema = converter.resolve_refs(json.loads(schema_json), "input")
    converter.visit(schema, "")
    if "date" in converter._rules:  # the converter's own rule table
        converter._rules["date"] = _DATE
    gbnf = converter.format_grammar()
    # This converter's string characters admit raw control characters, which JSON forbids in
    # a string (llama.cpp's own converter and json.gbnf exclude them): excluded here too.
    return gbnf.replace(_CONVERTER_CHAR, _JSON_CHAR).replace(_CONVERTER_DOT, _JSON_DOT).replace(_CONVERTER_EXP, _FINITE_EXP)


class _Converter(SchemaConverter):
    def visit(self, schema: Any, name: str) -> str:
        if not isinstance(schema, dict) or "$ref" in schema or "anyOf" in schema or "oneOf" in schema:
            return super().visit(schema, name)
        rule_name = name + "-" if name in ("root", "integer", "number", "string", "char") else name or "root"
        kind = schema.get("type")
        if "const" in schema or "enum" in schema:
            return super().visit(schema, name)
        if kind == "integer" and _has_bounds(schema):
            lo, hi = int_bounds(schema)
            return self._add_rule(rule_name, int_range(lo, hi) + " space")
        if kind == "number" and _has_bounds(schema):
            return self._add_rule(rule_name, number_range(*number_bounds(schema)) + " space")
        if kind == "string" and "pattern" not in schema and schema.get("format") in _FORMATS:
            fmt = schema["format"]
            if fmt == "ipv4":
                self._add_rule("ipv4-octet", int_range(0, 255))
            return self._add_rule(rule_name, rf'"\"" {_FORMATS[fmt]} "\"" space')
        if kind == "string" and "pattern" not in schema and ("minLength" in schema or "maxLength" in schema):
            char = self._add_primitive("char", PRIMITIVE_RULES["char"])
            return self._add_rule(rule_name, rf'"\"" {char}{_counts(schema.get("minLength", 0), schema.get("maxLength"))} "\"" space')
        items = schema.get("items")
        if kind in (None, "array") and isinstance(items, dict) and "prefixItems" not in schema:
            item = self.visit(items, f"{name}{'-' if name else ''}item")
            return self._add_rule(rule_name, _array(item, schema.get("minItems", 0), schema.get("maxItems")))
        return super().visit(schema, name)


def _counts(lo: int, hi: int | None) -> str:
    """A GBNF repetition of ``lo`` to ``hi`` (None: no limit)."""
    if hi is None:
        return "*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


def _array(item: str, lo: int, hi: int | None) -> str:
    if hi == 0:
        return '"[" space "]" space'
    rest = '("," space ' + item + ")" + _counts(max(lo - 1, 0), None if hi is None else hi - 1)
    body = f"{item} {rest}"
    return f'"[" space {body if lo > 0 else "(" + body + ")?"} "]" space'


def _has_bounds(schema: dict[str, Any]) -> bool:
    return any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))


def _finite(schema: dict[str, Any], key: str) -> float | None:
    v = schema.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return v


def number_bounds(schema: dict[str, Any]) -> tuple[float | None, bool, float | None, bool]:
    """A number schema's tightest bounds: (low, low exclusive, high, high exclusive); None:
    that side is open. Draft-4's boolean exclusiveMinimum/Maximum are read too."""
    lo, hi = _finite(schema, "minimum"), _finite(schema, "maximum")
    lo_x = hi_x = False
    xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if xlo is True and lo is not None:
        lo_x = True
    elif (x := _finite(schema, "exclusiveMinimum")) is not None and (lo is None or x >= lo):
        lo, lo_x = x, True
    if xhi is True and hi is not None:
        hi_x = True
    elif (x := _finite(schema, "exclusiveMaximum")) is not None and (hi is None or x <= hi):
        hi, hi_x = x, True
    return lo, lo_x, hi, hi_x


def int_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """An integer schema's inclusive bounds (None: that side open)."""
    lo, lo_x, hi, hi_x = number_bounds(schema)
    return _int_lo(lo, lo_x), _int_hi(hi, hi_x)


def _int_lo(lo: float | None, excl: bool) -> int | None:
    if lo is None:
        return None
    return math.floor(lo) + 1 if excl else math.ceil(lo)


def _int_hi(hi: float | None, excl: bool) -> int | None:
    if hi is None:
        return None
    return math.ceil(hi) - 1 if excl else math.floor(hi)


def int_range(lo: int | None, hi: int | None) -> str:
    """A GBNF expression of the integers from ``lo`` to ``hi`` inclusive, in JSON's
    spelling (no leading zeros, no "-0"); None: that side open (to 16 digits)."""
    lo = -MAX_MAGNITUDE if lo is None else max(lo, -MAX_MAGNITUDE)
    hi = MAX_MAGNITUDE if hi is None else min(hi, MAX_MAGNITUDE)
    alts: list[str] = []
    if hi >= 0:
        alts.extend(_naturals(max(lo, 0), hi))
    if lo < 0:
        alts.extend(f'"-" {alt}' for alt in _naturals(max(1, -min(hi, -1)), -lo))
    if not alts:
        raise ValueError(f"no integer lies between {lo} and {hi}")
    return "(" + " | ".join(alts) + ")"


def _naturals(a: int, b: int) -> list[str]:
    """Alternatives spelling each integer of [a, b] (0 <= a): one per digit count."""
    alts: list[str] = []
    if a > b:
        return alts
    if a == 0:
        alts.append('"0"')
        a = 1
    for n in range(len(str(a)), len(str(b)) + 1) if a <= b else ():
        lo = a if n == len(str(a)) else 10 ** (n - 1)
        hi = b if n == len(str(b)) else 10**n - 1
        alts.append(_between(str(lo), str(hi)))
    return alts


def _any_digits(n: int) -> str:
    return "" if n == 0 else "[0-9]" if n == 1 else f"[0-9]{{{n}}}"


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _digit_class(lo: str, hi: str) -> str:
    return f'"{lo}"' if lo == hi else f"[{lo}-{hi}]"


def _between(a: str, b: str) -> str:
    """Digit strings of a's length from a to b (same length, a <= b)."""
    if not a:
        return ""
    if a[0] == b[0]:
        return _seq(f'"{a[0]}"', _between(a[1:], b[1:]))
    n = len(a) - 1
    if set(a[1:]) <= {"0"} and set(b[1:]) <= {"9"}:
        return _seq(_digit_class(a[0], b[0]), _any_digits(n))
    alts = [_seq(f'"{a[0]}"', _at_least(a[1:]))]
    if int(a[0]) + 1 <= int(b[0]) - 1:
        alts.append(_seq(_digit_class(str(int(a[0]) + 1), str(int(b[0]) - 1)), _any_digits(n)))
    alts.append(_seq(f'"{b[0]}"', _at_most(b[1:])))
    return "(" + " | ".join(alts) + ")"


def _at_least(s: str) -> str:
    """Digit strings of s's length (leading zeros allowed) at least s."""
    if not s or set(s) == {"0"}:
        return _any_digits(len(s))
    alts = [_seq(f'"{s[0]}"', _at_least(s[1:]))]
    if s[0] != "9":
        alts.append(_seq(_digit_class(str(int(s[0]) + 1), "9"), _any_digits(len(s) - 1)))
    return "(" + " | ".join(alts) + ")"


def _at_most(s: str) -> str:
    """Digit strings of s's length (leading zeros allowed) at most s."""
    if not s or set(s) == {"9"}:
        return _any_digits(len(s))
    alts = [_seq(f'"{s[0]}"', _at_most(s[1:]))]
    if s[0] != "0":
        alts.append(_seq(_digit_class("0", str(int(s[0]) - 1)), _any_digits(len(s) - 1)))
    return "(" + " | ".join(alts) + ")"


def number_range(lo: float | None, lo_x: bool, hi: float | None, hi_x: bool) -> str:
    """A GBNF expression of numbers within the bounds, no exponent: the integers within,
    and decimals ``I.ddd`` whose whole unit interval lies within. Every number it allows is
    within the bounds; a range narrower than a unit may allow only some (none: ValueError)."""
    alts: list[str] = []
    ilo, ihi = _int_lo(lo, lo_x), _int_hi(hi, hi_x)
    if ilo is None or ihi is None or ilo <= ihi:
        alts.append(int_range(ilo, ihi))
    # Non-negative I.ddd lies in [I, I+1): I within the low bound, I+1 within the high one.
    p_lo = max(0, ilo if ilo is not None else 0)
    p_hi = None if hi is None else math.floor(hi) - 1
    if p_hi is None or p_lo <= p_hi:
        alts.append(f"{int_range(p_lo, p_hi)} {_FRACTION}")
    # -I.ddd lies in (-(I+1), -I]: -I within the high bound, -(I+1) within the low one.
    n_lo = 0 if hi is None else max(0, math.floor(-hi) + 1 if hi_x else math.ceil(-hi))
    n_hi = None if lo is None else math.floor(-lo) - 1
    if n_hi is None or n_lo <= n_hi:
        alts.append(f'"-" {int_range(n_lo, n_hi)} {_FRACTION}')
    # An exclusive integer low bound k >= 0 (exclusiveMinimum: 0): k.ddd with a non-zero digit.
    if lo_x and lo is not None and float(lo).is_integer() and lo >= 0 and (hi is None or hi >= lo + 1):
        alts.append(f'"{int(lo)}." [0-9]{{0,14}} [1-9]')
    if not alts:
        raise ValueError("no number in the range can be written to 15 decimals")
    return "(" + " | ".join(alts) + ")"
