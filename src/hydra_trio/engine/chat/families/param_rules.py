"""The call rules markup families share (llguidance's Lark): a tool's parameters one tagged
value after another (``xml_param_rules``: the XML-like families, Gemma 4's, Kimi K3's, Muse
Glimmer's), and a call that is a head, its arguments' JSON and a tail (``json_rule``). Pure."""

from __future__ import annotations

from collections.abc import Callable

from ...structured import SchemaExpr, literal, regex, seq
from ..tools import Tool
from .toolformat import CallRule

MAX_TEXT_COUNT = 1 << 16  # a text parameter's length bound written into its regex (past it: unbounded)


def xml_param_rules(
    tool: Tool,
    i: int,
    schema: SchemaExpr,
    write: Callable[[str], tuple[str, str]],
    padded: bool = False,
) -> tuple[str, list[str]]:
    """A tool's parameters as a sequence of XML parameters in the schema's order (required
    ones always, others optional): a string's value is text without ``<``, others their
    schema's JSON. ``write(key)``: the literal before and after a parameter's value."""
    props = tool.parameters.get("properties") if isinstance(tool.parameters, dict) else None
    required = set(tool.parameters.get("required") or ()) if isinstance(tool.parameters, dict) else set()
    rules: list[str] = []
    parts: list[str] = []
    for j, (key, prop) in enumerate((props or {}).items()):
        value = f"t{i}-p{j}"
        if isinstance(prop, dict) and prop.get("type") == "string":
            # A string is written as text (typed_value reads it so): no "<" (it would end
            # the value) and, where no newline is written around it, no newline at its edges.
            lo, hi = prop.get("minLength"), prop.get("maxLength")
            lo = lo if isinstance(lo, int) and not isinstance(lo, bool) and 0 <= lo <= MAX_TEXT_COUNT else 0
            bounded = isinstance(hi, int) and not isinstance(hi, bool) and lo <= hi <= MAX_TEXT_COUNT
            count = f"{{{lo},{hi}}}" if bounded else f"{{{lo},}}" if lo else "*"
            chars = "[^<]" if padded else "[^<\\n]"
            rules.append(f"{value}: {regex(chars + count)}")
        else:
            rules.append(f"{value}: {schema(prop, f'tools[{i}].function.parameters.properties.{key}')}")
        before, after = write(key)
        part = seq(literal(before), value, literal(after))
        parts.append(part if key in required else f"({part})?")
    return seq(*parts), rules


def json_rule(head: Callable[[Tool], str], tail: str) -> CallRule:
    """A call written as ``head(tool)``, the arguments' JSON (their schema), then ``tail``."""

    def rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
        args = f"t{i}-args: {schema(tool.parameters, f'tools[{i}].function.parameters')}"
        return seq(head(tool), f"t{i}-args", literal(tail)), [args]

    return rule
