"""What a reply must follow: a request's output constraint (``Constraint``, as it asked) and
the one grammar it becomes (``OutputGrammar``: llguidance's Lark, JSON schemas inside it as
``%json``, or a client's own GBNF), with its lazy triggers. Pure: the compile is guidance.py's.

A request asks for at most one output format (``response_format``, llama-server's
``json_schema`` or ``grammar``). Beside tools, the format's turn depends on ``tool_choice``:
``none``: the format; ``required`` or a named tool: the calls (the format waits for a later
text turn); ``auto``: "a call in the template's syntax, or a document of the format", one
grammar from the first token (llama.cpp's generic handler's answer). How calls are written is
the chat template's (engine/chat/call_grammar.py); this module writes the rest.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ...wire.errors import bad_param
from .schema_policy import open_schema, prepare_schema, schema_json, whole_schema_problem

Triggers = tuple[str, ...]  # a lazy grammar's trigger patterns; (): the grammar holds from the first token
MAX_GRAMMAR_CHARS = 256 * 1024  # a grammar's text, a client's GBNF included
MAX_GBNF_NESTING = 1000  # parentheses deep in a client's GBNF (llguidance's converter recurses)


@dataclass(frozen=True, slots=True)
class OutputGrammar:
    """A grammar as llguidance compiles it: ``text`` in ``syntax`` (the engine writes Lark; a
    client's ``grammar`` is GBNF), its lazy ``triggers`` (tool_choice auto), the request key
    errors name (``param``), and what the schema policy left out (``relaxed``, logged once
    when it compiles). A pure value: it pickles, compares and keys the compiled cache."""

    text: str
    syntax: Literal["lark", "gbnf"] = "lark"
    triggers: Triggers = ()
    param: str = field(default="grammar", compare=False)
    relaxed: tuple[str, ...] = field(default=(), compare=False)
    # Each schema in it as (the key it came from, its expression): a grammar that fails to
    # compile is retried schema by schema, so the error names the one at fault (a tool's).
    parts: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must follow, as it asked: any JSON object, a JSON schema
    (``strict``: OpenAI's structured outputs, unenforceable keywords refused), GBNF text, or
    calls of its tools (``answer``: under ``auto``, the typed answer the reply may be instead)."""

    kind: Literal["json_object", "json_schema", "gbnf", "tools"]
    value: Any  # the schema (json_schema), the text (gbnf), None (json_object), the ToolRequest (tools)
    param: str  # the key it came from: errors name it
    strict: bool = False
    answer: Constraint | None = None


def output_constraint(req: dict[str, Any]) -> Constraint | None:
    """The request's output format: OpenAI's ``response_format`` (``json_object``, or
    ``json_schema`` with its ``schema`` and ``strict``), llama-server's ``json_schema`` (a
    schema) and ``grammar`` (GBNF). One at most; ``{"type": "text"}``, ``{}`` and ``""`` ask
    nothing."""
    found: list[Constraint] = []
    rf = req.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise bad_param("response_format must be an object with a type", "response_format")
        kind = rf["type"]
        if kind == "json_object":
            # llama-server's extension: a "schema" beside json_object constrains to it.
            schema = rf.get("schema")
            found.append(
                Constraint("json_object", None, "response_format")
                if schema is None
                else Constraint("json_schema", schema, "response_format.schema")
            )
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict):
                raise bad_param("response_format.json_schema must "
                                "be an object (name, schema, strict)", "response_format")
            if spec.get("name") is not None and not isinstance(spec["name"], str):
                raise bad_param("response_format.json_schema.name must be a string", "response_format")
            if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
                raise bad_param("response_format.json_schema.strict must be a boolean", "response_format")
            schema = spec.get("schema")  # absent: any JSON object (OpenAI's schema is optional)
            found.append(
                Constraint("json_object", None, "response_format")
                if schema is None
                else Constraint(
                    "json_schema", schema, "response_format.json_schema.schema", strict=spec.get("strict") is True
                )
            )
        elif kind != "text":
            raise bad_param(
                f"response_format type {kind!r} is not supported (text, json_object, json_schema)", "response_format"
            )
    if req.get("json_schema") not in (None, {}):
        found.append(Constraint("json_schema", req["json_schema"], "json_schema"))
    if req.get("grammar") not in (None, ""):
        found.append(Constraint("gbnf", req["grammar"], "grammar"))
    if len(found) > 1:
        raise bad_param(
            f"{found[0].param} and {found[1].param} both constrain the output: send one", found[1].param.split(".")[0]
        )
    return found[0] if found else None


def request_constraint(req: dict[str, Any], tools: Any) -> Constraint | None:
    """The one constraint of a request whose tools were parsed already (``tools``: a
    chat.ToolRequest, or None), by the rules in this module's docstring."""
    constraint = output_constraint(req)
    if tools is None or tools.choice == "none":
        return constraint
    if constraint is not None and constraint.kind == "gbnf":
        raise bad_param('grammar with tools is not supported (unless '
                        'tool_choice is "none"): send a JSON schema', "grammar")
    if constraint is not None and tools.choice == "auto":
        return Constraint("tools", tools, "tools", answer=constraint)
    return Constraint("tools", tools, "tools")


# ---- Lark text ---------------------------------------------------------------------------


def literal(text: str) -> str:
    """``text`` as a Lark string literal ("" for none): JSON's escapes are Lark's."""
    return json.dumps(text, ensure_ascii=False) if text else ""


def regex(pattern: str) -> str:
    """A regex terminal ``/pattern/``."""
    return "/" + pattern.replace("/", "\\/") + "/"


def seq(*parts: str) -> str:
    """Grammar expressions in sequence, empty ones left out."""
    return " ".join(p for p in parts if p)


class SchemaRules:
    """JSON schemas written into one grammar, each as ``%json`` under the schema policy, and
    what the policy left out of them (for the compile's log line)."""

    def __init__(self, *, strict: bool = False) -> None:
        self.strict = strict
        self.relaxed: list[str] = []
        self.parts: list[tuple[str, str]] = []

    def prepared(self, schema: Any, param: str, *, ref_base: str = "#") -> dict[str, Any]:
        """``schema`` under the policy, to be placed at ``ref_base`` of a larger document."""
        prepared = prepare_schema(schema, param, strict=self.strict, ref_base=ref_base)
        self.relaxed.extend(f"{param}{r}" for r in prepared.relaxed)
        return prepared.schema

    def json(self, schema: dict[str, Any], param: str) -> str:
        """A prepared schema (or a document built of prepared ones) as one expression. Without
        strict, one llguidance cannot compile at all is relaxed whole (to its type: every schema
        a client sends is served); with strict it is compiled as it is, and refused."""
        expr = "%json " + schema_json(schema, strict=self.strict)
        if not self.strict and (why := whole_schema_problem(expr)) is not None:
            self.relaxed.append(f"{param} (the whole schema but its type: {why})")
            expr = "%json " + schema_json(open_schema(schema), strict=False)
        self.parts.append((param, expr))
        return expr

    def __call__(self, schema: Any, param: str) -> str:
        return self.json(self.prepared(schema, param), param)


SchemaExpr = Callable[[Any, str], str]  # (a schema, the key it came from) -> its grammar expression


def format_grammar(constraint: Constraint) -> OutputGrammar:
    """The grammar of an output format (json_object, json_schema, gbnf); a 400 naming the
    problem."""
    if constraint.kind == "gbnf":
        return OutputGrammar(check_gbnf(constraint.value, constraint.param), "gbnf", param=constraint.param)
    rules = SchemaRules(strict=constraint.strict)
    text = "start: " + format_expr(constraint, rules)
    return OutputGrammar(text, param=constraint.param, relaxed=tuple(rules.relaxed), parts=tuple(rules.parts))


def format_expr(constraint: Constraint, rules: SchemaExpr) -> str:
    """A JSON format as one grammar expression (for ``start``, or one side of a choice)."""
    if constraint.kind == "json_object":
        return rules({"type": "object"}, constraint.param)
    if constraint.kind == "json_schema":
        return rules(constraint.value, constraint.param)
    raise bad_param(f"{constraint.param} cannot be combined with tool calls: send a JSON schema", constraint.param)


def check_gbnf(text: Any, param: str) -> str:
    """GBNF text a request sent (llama-server's ``grammar``), within the bounds its conversion
    is safe in; its syntax is checked by the compile."""
    if not isinstance(text, str):
        raise bad_param(f"{param} must be a string (GBNF)", param)
    if not text.strip():
        raise bad_param(f"{param} is empty", param)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad_param(f"{param} is {len(text)} characters; at most {MAX_GRAMMAR_CHARS}", param)
    if _nesting(text) > MAX_GBNF_NESTING:
        raise bad_param(f"{param} nests parentheses more than {MAX_GBNF_NESTING} deep", param)
    return text


def _nesting(text: str) -> int:
    """Deepest parenthesis nesting outside string literals, character classes and comments."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"[":
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest
