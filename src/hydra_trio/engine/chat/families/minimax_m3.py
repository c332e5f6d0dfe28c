"""MiniMax M3 (as llama.cpp's common/parsers/minimax-m3.cpp): every tag after the namespace
token ``]<]minimax[>[``, the calls in one section, the parameter's name its tag::

    ]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="get_time">]<]minimax[>[<city>Tokyo]<]minimax[>[</city>]<]minimax[>[</invoke>
    ]<]minimax[>[</tool_call>

A value the schema allows to be a string is its text up to its closing tag, whatever it
holds; an object's members and an array's ``<item>``s are elements again (the template's
``to_xml``: recursively expanded); any other value is its JSON (the text where it is not
JSON). A turn without reasoning opens with a bare ``</mm:think>``, which is not content. Pure."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ....wire.jsontext import MAX_MODEL_DEPTH
from ...structured import SchemaExpr, literal, regex, seq
from ..markup import NON_SPACE, typed_value
from ..tools import Tool
from .param_rules import MAX_TEXT_COUNT
from .roster import register
from .toolformat import Block, Call, Detect, Props, ToolFormat, Trigger

NS = "]<]minimax[>["
OPEN, CLOSE = NS + "<tool_call>", NS + "</tool_call>"
INVOKE, INVOKE_END = NS + '<invoke name="', NS + "</invoke>"
MAX_EXPANDED = 8  # schema levels the grammar writes as elements; deeper values are their JSON

_FAIL = object()  # a value that is not one: the call is not a call


# ---- the reader ---------------------------------------------------------------------------------


def _alternatives(schema: Any) -> list[Mapping[str, Any]]:
    """The schema and its anyOf / oneOf alternatives."""
    if not isinstance(schema, Mapping):
        return []
    found = [schema]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            found += [a for a in schema[key] if isinstance(a, Mapping)]
    return found


def _types(schema: Mapping[str, Any]) -> set[str]:
    kind = schema.get("type")
    return (
        {kind}
        if isinstance(kind, str)
        else {k for k in kind if isinstance(k, str)}
        if isinstance(kind, list)
        else set()
    )


def _may_be_string(schema: Any) -> bool:
    """A string accepts anything: a value that may be one is its text (as llama.cpp's)."""
    return any("string" in _types(a) for a in _alternatives(schema))


def _shaped(schema: Any, array: bool) -> Mapping[str, Any] | None:
    """The alternative of ``schema`` that is an array (``array``) or an object, if any."""
    for alt in _alternatives(schema):
        if ("array" in _types(alt) or "items" in alt) if array else ("object" in _types(alt) or "properties" in alt):
            return alt
    return None


def _tag_at(body: str, pos: int) -> str | None:
    """The name of the opening tag at ``pos`` (``NS<name>``), else None."""
    if not body.startswith(NS + "<", pos) or body.startswith(NS + "</", pos):
        return None
    start = pos + len(NS) + 1
    end = body.find(">", start)
    name = body[start:end] if end >= 0 else ""
    return name if name and not any(c in name for c in '<"\n') else None


def _members(body: str, pos: int, close: str, schema: Any, depth: int) -> tuple[Any, int]:
    """``NS<key>value NS</key>`` ... up to ``close``: (the object, the end), or (_FAIL, pos)."""
    props = (_shaped(schema, False) or {}).get("properties")
    props = props if isinstance(props, Mapping) else {}
    out: dict[str, Any] = {}
    while (m := NON_SPACE.search(body, pos)) is not None:
        if body.startswith(close, m.start()):
            return out, m.start() + len(close)
        key = _tag_at(body, m.start())
        if key is None:
            return _FAIL, pos
        value, pos = _value(body, m.start() + len(NS) + len(key) + 2, key, props.get(key), depth + 1)
        if value is _FAIL:
            return _FAIL, pos
        out[key] = value
    return _FAIL, pos


def _items(body: str, pos: int, close: str, schema: Any, depth: int) -> tuple[Any, int]:
    """``NS<item>value NS</item>`` ... up to ``close``: (the list, the end), or (_FAIL, pos)."""
    items = (_shaped(schema, True) or {}).get("items")
    out: list[Any] = []
    while (m := NON_SPACE.search(body, pos)) is not None:
        if body.startswith(close, m.start()):
            return out, m.start() + len(close)
        if _tag_at(body, m.start()) != "item":
            return _FAIL, pos
        value, pos = _value(body, m.start() + len(NS) + len("<item>"), "item", items, depth + 1)
        if value is _FAIL:
            return _FAIL, pos
        out.append(value)
    return _FAIL, pos


def _value(body: str, pos: int, tag: str, schema: Any, depth: int) -> tuple[Any, int]:
    """The value of the element ``tag`` whose text starts at ``pos``, and where it ends."""
    close = f"{NS}</{tag}>"
    if depth > MAX_MODEL_DEPTH:
        return _FAIL, pos
    if not _may_be_string(schema) and (m := NON_SPACE.search(body, pos)) is not None:
        child = _tag_at(body, m.start())
        if child is not None:  # elements: an array's items or an object's members
            array, members = _shaped(schema, True), _shaped(schema, False)
            # the one shape the schema allows; else (both, or no schema) what the first element says
            as_array = array is not None if (array is None) != (members is None) else child == "item"
            return (_items if as_array else _members)(body, pos, close, schema, depth)
    end = body.find(close, pos)
    if end < 0:
        return _FAIL, pos
    text = body[pos:end]
    if not text.strip() and not _may_be_string(schema):  # an empty container prints nothing
        text = "[]" if _shaped(schema, True) is not None else "{}" if _shaped(schema, False) is not None else text
    return typed_value(text, schema if isinstance(schema, Mapping) else None), end + len(close)


def _read_m3(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    calls: list[Call] = []
    pos = 0
    while (m := NON_SPACE.search(body, pos)) is not None:
        if not body.startswith(INVOKE, m.start()):
            return None
        head = m.start() + len(INVOKE)
        end = body.find('">', head)
        name = body[head:end] if end >= 0 else ""
        if not name or '"' in name or "<" in name:
            return None
        args, pos = _members(body, end + 2, INVOKE_END, {"properties": props_of(name) or {}}, 0)
        if args is _FAIL:
            return None
        calls.append((name, args, None))
    return calls or None


# ---- the call rule --------------------------------------------------------------------------------


def _text(schema: Mapping[str, Any]) -> str:
    """A string's text: no ``]`` (the namespace token that closes it starts with one), its
    length within the schema's bounds."""
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    lo = lo if isinstance(lo, int) and not isinstance(lo, bool) and 0 <= lo <= MAX_TEXT_COUNT else 0
    bounded = isinstance(hi, int) and not isinstance(hi, bool) and lo <= hi <= MAX_TEXT_COUNT
    count = f"{{{lo},{hi}}}" if bounded else f"{{{lo},}}" if lo else "*"
    return regex("[^\\]]" + count)


class _Writer:
    """One tool's arguments as elements, as the template's ``to_xml`` prints them: required
    members in the schema's order, the others optional after them in it; its rules named
    ``t{i}-v{n}``."""

    def __init__(self, i: int, schema: SchemaExpr) -> None:
        self.i, self.schema, self.rules = i, schema, []

    def rule(self, expr: str) -> str:
        name = f"t{self.i}-v{len(self.rules)}"
        self.rules.append(f"{name}: {expr}")
        return name

    def members(self, schema: Mapping[str, Any], where: str, depth: int) -> str:
        props = schema.get("properties")
        required = set(schema.get("required") or ())
        parts = []
        for key, prop in (props.items() if isinstance(props, Mapping) else ()):
            part = seq(
                literal(f"{NS}<{key}>"),
                self.value(prop, f"{where}.properties.{key}", depth + 1),
                literal(f"{NS}</{key}>"),
            )
            parts.append(part if key in required else f"({part})?")
        return seq(*parts)

    def value(self, schema: Any, where: str, depth: int) -> str:
        if not isinstance(schema, Mapping) or depth > MAX_EXPANDED:
            return self.rule(self.schema(schema, where))
        if _may_be_string(schema):
            return self.rule(_text(schema))
        if schema.get("anyOf") or schema.get("oneOf"):
            options = [self.value(alt, f"{where}.{k}[{n}]", depth + 1) for k in ("anyOf", "oneOf")
                       for n, alt in enumerate(schema.get(k) or ())]
            return self.rule(" | ".join(options)) if options else self.rule(self.schema(schema, where))
        if isinstance(schema.get("properties"), Mapping) and schema["properties"]:
            return self.rule(self.members(schema, where, depth))
        if isinstance(schema.get("items"), Mapping):
            item = seq(
                literal(f"{NS}<item>"),
                self.value(schema["items"], f"{where}.items", depth + 1),
                literal(f"{NS}</item>"),
            )
            return self.rule(f"({item})*")
        return self.rule(self.schema(schema, where))


def _m3_rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
    writer = _Writer(i, schema)
    params = tool.parameters if isinstance(tool.parameters, Mapping) else {}
    args = writer.members(params, f"tools[{i}].function.parameters", 0)
    return seq(literal(f'{INVOKE}{tool.name}">'), args, literal(INVOKE_END + "\n")), writer.rules


MINIMAX_M3 = register(ToolFormat(
    "minimax_m3",
    "arguments",
    before=OPEN + "\n",
    after=CLOSE,
    block=Block(openers=(OPEN,), closer=CLOSE, read=_read_m3, call_end=INVOKE_END),
    call_rule=_m3_rule,
    # the bare close tag of a turn without reasoning (the model's, or its prompt's with thinking
    # off); with reasoning not split, a think block's close tag goes too
    dropped=("</mm:think>",),
    triggers=(Trigger(OPEN, False, "\n" + INVOKE),),
    # before Hermes' <tool_call>, which its tags hold too (as llama.cpp tells it)
    detect=(Detect(75, (NS, "<tool_call>", "<invoke name=")),),
))
