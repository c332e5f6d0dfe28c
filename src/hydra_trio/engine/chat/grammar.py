"""Output constraints, the request side: what a request asks its output to follow
(``Constraint``: any JSON object, a JSON schema, GBNF text, or calls of its tools) and the one
GBNF string (with lazy triggers) it stands for. Pure Python, on the request's own thread:
the compile on the GPU worker and the cache of compiled grammars are ``llama/grammar.py``'s.

JSON schemas are converted by llama-cpp-python's converter (``llama/grammar.py``
``convert_schema``); what it cannot enforce is made enforceable here or refused, naming the
keyword. Tool calls are written in the template's ``ToolFormat`` (``formats.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from ...wire.errors import bad_param
from ..llama import JSON_OBJECT_GBNF, MAX_GBNF_CHARS, MAX_GBNF_NESTING, Triggers, convert_schema
from .formats import CALL_PREFIX, GENERIC, ToolFormat, Trigger
from .schema import check_schema
from .tools import ToolRequest, parse_tools

GRAMMAR_CACHE_SIZE = 64  # conversions kept (as many as the worker keeps compiled grammars)
MAX_PARALLEL_CALLS = 8  # calls one reply's tool grammar allows with parallel_tool_calls

@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must follow, as it asked: any JSON object, a JSON schema,
    GBNF text, or calls of its tools. The engine turns it into the GBNF (and lazy triggers)
    SamplingParams carries (llama/grammar.py)."""

    kind: Literal["json_object", "json_schema", "gbnf", "tools"]
    value: Any  # the schema (json_schema), the text (gbnf), None (json_object), the ToolRequest (tools)
    param: str  # the key it came from: errors name it

    def grammar_engine(self, triggers: Triggers) -> Literal["llama", "llguidance"]:
        """Which grammar engine runs it: a client's own GBNF on llguidance, whose per-token
        work is bounded (llama/grammar.py, GuidanceCache); the grammars built here, not ambiguous, and any
        lazy one on llama.cpp's."""
        return "llguidance" if self.kind == "gbnf" and not triggers else "llama"


def parse_constraint(req: dict[str, Any]) -> Constraint | None:
    """The request's output constraint: OpenAI's ``response_format`` (``json_object``, or
    ``json_schema`` with its ``schema``), llama-server's ``json_schema`` (a schema) and
    ``grammar`` (GBNF), or its tools (unless ``tool_choice`` is "none"). One at most;
    ``{"type": "text"}``, ``{}`` and ``""`` ask nothing."""
    return request_constraint(req, parse_tools(req))


def request_constraint(req: dict[str, Any], tools: ToolRequest | None) -> Constraint | None:
    """The one constraint of a request whose tools were parsed already (``tools``)."""
    constraint = _output_constraint(req)
    if tools is None or tools.choice == "none":
        return constraint
    if constraint is not None:
        key = constraint.param.split(".")[0]
        raise bad_param(f'{key} with tools is not supported (unless tool_choice is "none")', key)
    return Constraint("tools", tools, "tools")


def _output_constraint(req: dict[str, Any]) -> Constraint | None:
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
                raise bad_param("response_format.json_schema must be an object (name, schema, strict)", "response_format")
            if spec.get("name") is not None and not isinstance(spec["name"], str):
                raise bad_param("response_format.json_schema.name must be a string", "response_format")
            if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
                raise bad_param("response_format.json_schema.strict must be a boolean", "response_format")
            schema = spec.get("schema")  # absent: any JSON object (OpenAI's schema is optional)
            found.append(
                Constraint("json_object", None, "response_format")
                if schema is None
                else Constraint("json_schema", schema, "response_format.json_schema.schema")
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


def constraint_gbnf(constraint: Constraint, tool_format: ToolFormat = GENERIC) -> tuple[str, Triggers]:
    """The GBNF a request's output constraint stands for, and its lazy triggers
    (parse_generation's ``to_gbnf``); ``tool_format``: how the chat template writes tool
    calls. Pure Python, on the request's own thread; a 400 naming the problem."""
    if constraint.kind == "json_object":
        return JSON_OBJECT_GBNF, ()  # any JSON object: llama.cpp's grammars/json.gbnf
    if constraint.kind == "json_schema":
        return schema_gbnf(constraint.value, constraint.param), ()
    if constraint.kind == "tools":
        return tools_gbnf(constraint.value, tool_format)
    return check_gbnf(constraint.value, constraint.param), ()


def tools_gbnf(request: ToolRequest, fmt: ToolFormat) -> tuple[str, Triggers]:
    """The grammar of a reply's tool calls in ``fmt``, and its lazy triggers.

    One call is ``{"name": "N", "<args>": ARGS}`` for any callable tool (only the named one
    for a named function), ARGS its parameters schema's grammar. Each schema is converted on
    its own (its ``$ref``s point into its own document; an error names its tool) and its
    rules renamed apart. ``required`` and a named function: the reply is the calls (no
    triggers). ``auto``: lazy, free text until the model writes a trigger (see
    ``trigger_pattern``). parallel: 1..MAX_PARALLEL_CALLS calls, else exactly one."""
    rules: list[str] = []
    calls: list[str] = []
    for i, tool in enumerate(request.tools):
        if tool not in request.callable:
            continue
        if fmt.block is not None and fmt.block.call_rule is not None:  # a family's own markup (families.py)
            call, more_rules = fmt.block.call_rule(tool, i, _tool_schema_gbnf, _renamed)
            calls.append(call)
            rules.extend(more_rules)
            continue
        if fmt.recipient:  # functionary: the tool's name on its line, then its arguments' JSON
            rules.append(_renamed(_tool_schema_gbnf(tool.parameters, f"tools[{i}].function.parameters"), f"t{i}-"))
            calls.append(f"{_literal(tool.name + chr(10))} t{i}-root")
            continue
        if fmt.harmony:  # gpt-oss: a commentary message to the function, its body the JSON
            head = f"<|channel|>commentary to=functions.{tool.name} <|constrain|>json<|message|>"
            rules.append(_renamed(_tool_schema_gbnf(tool.parameters, f"tools[{i}].function.parameters"), f"t{i}-"))
            calls.append(f"{_literal(head)} t{i}-root")
            continue
        schema = _tool_schema_gbnf(tool.parameters, f"tools[{i}].function.parameters")
        rules.append(_renamed(schema, f"t{i}-"))
        head = f'{CALL_PREFIX}{tool.name}", "{fmt.args_key}": '
        calls.append(f"{_literal(head)} t{i}-root {_literal('}')}")
    block = " ".join(x for x in (_literal(fmt.call_open), "call", _literal(fmt.call_close)) if x)
    between = _literal(fmt.between)
    # harmony: one call a reply (the model ends its message with <|call|> and stops)
    more = (
        f" ({between + ' ' if between else ''}call-block){{0,{MAX_PARALLEL_CALLS - 1}}}"
        if request.parallel and not fmt.harmony
        else ""
    )
    before = _literal(fmt.before)
    if before and fmt.before_optional:
        before = f"({before})?"
    root = " ".join(x for x in (before, f"call-block{more}", _literal(fmt.after)) if x)
    gbnf = "\n".join([f"root ::= {root}", f"call-block ::= {block}", f"call ::= {' | '.join(calls)}", *rules])
    if len(gbnf) > MAX_GBNF_CHARS:
        raise bad_param(f"tools: the tools' grammar is over {MAX_GBNF_CHARS} characters", "tools")
    if request.choice != "auto":
        triggers: Triggers = ()
    elif fmt.recipient:
        triggers = recipient_patterns(fmt, [t.name for t in request.callable])
    else:
        triggers = tuple(trigger_pattern(t) for t in (*fmt.triggers, *tool_triggers(fmt, request)))
    return gbnf, triggers


def tool_triggers(fmt: ToolFormat, request: ToolRequest) -> tuple[Trigger, ...]:
    """The format's trigger per callable tool (``ToolFormat.tool_trigger``), its name written in."""
    if not fmt.tool_trigger:
        return ()
    text, then = fmt.tool_trigger
    return tuple(Trigger(text.replace("{name}", t.name), False, then.replace("{name}", t.name)) for t in request.callable)


def trigger_pattern(trigger: Trigger) -> str:
    """A lazy grammar's trigger as llama.cpp's pattern (an ECMAScript std::regex).

    llama.cpp (llama-grammar.cpp, ``llama_grammar_accept_impl``) appends each accepted
    token's text to a buffer of everything generated while the grammar waits, searches each
    pattern in that whole buffer after every token (``regex_match`` of the whole buffer for a
    ``^...$`` pattern), and on a match feeds the grammar the buffer from the first non-empty
    capture group on, the start of the token it falls in included. So a trigger written over
    several tokens triggers once its last piece is accepted. Text fed that the grammar
    refuses makes llama.cpp throw, which aborts the process; so the pattern matches only at
    the buffer's end and only the trigger followed by a beginning of the fixed text the
    grammar writes after it: exactly what is fed is then a beginning of the grammar. (A
    token that carries the trigger and other text leaves the grammar waiting: that reply
    is unconstrained, and its calls are parsed as written.)"""
    body = _regex_literal(trigger.text) + _optional_tail(trigger.then)
    return f"^\\s*({body})$" if trigger.at_start else f"({body})$"


def recipient_patterns(fmt: ToolFormat, names: list[str]) -> Triggers:
    """Functionary's lazy trigger: a recipient line after the opener that names a tool.
    llama.cpp's ``>>>(?!all)``, searched after each token, also matches a ``>>>`` that ends
    the text before ``all`` comes (a ``>>>all`` content line written over two tokens is
    forced into a call); this waits for the first character that parts the name from
    content's ``all\\n`` line, so ``>>>all`` never triggers, and matches only a beginning of
    ``>>>NAME\\n`` (as much of it as the last token carries): what is fed is a beginning of
    the grammar. As llama.cpp's, it is searched in the generated text only, so a call the
    reply opens with (after the prompt's ``>>>``) is not triggered; nor is a tool named ``all``."""
    content = fmt.recipient + "\n"
    alternatives = []
    for name in names:
        line = name + "\n"
        parts = next((i for i, (a, b) in enumerate(zip(line, content, strict=False)) if a != b), None)
        if parts is None:  # the name is content's recipient (a shorter one cannot be: names have no newline)
            continue
        alternatives.append(_regex_literal(line[: parts + 1]) + _optional_tail(line[parts + 1:]))
    if not alternatives:  # still lazy (no triggers would hold the grammar from the start): one that never matches
        return ("([^\\s\\S])$",)
    names_re = "|".join(alternatives)
    return (f"({_regex_literal(fmt.opener)}(?:{names_re}))$",)


def _optional_tail(text: str) -> str:
    """A regex matching any beginning of ``text`` (the empty one included)."""
    tail = ""
    for c in reversed(text):
        tail = f"(?:{_regex_literal(c)}{tail})?"
    return tail


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching it, the same in ECMAScript and Python."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in "\\^$.*+?()[]{}|/" else c for c in text)


def _literal(text: str) -> str:
    """``text`` as a GBNF string literal ("" for none): JSON's escapes are GBNF's."""
    return json.dumps(text) if text else ""


@lru_cache(maxsize=4 * GRAMMAR_CACHE_SIZE)  # a request of the same tools renames the same rules
def _renamed(gbnf: str, prefix: str) -> str:
    """``gbnf`` with every rule name prefixed: names are runs of GBNF's word characters
    outside string literals, character classes, repetition counts and comments."""
    out: list[str] = []
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c in "\"[{":
            close = {'"': '"', "[": "]", "{": "}"}[c]
            j = i + 1
            while j < n and gbnf[j] != close:
                j += 2 if gbnf[j] == "\\" else 1
            out.append(gbnf[i:j + 1])
            i = j + 1
        elif c == "#":
            j = gbnf.find("\n", i)
            j = n if j < 0 else j
            out.append(gbnf[i:j])
            i = j
        elif c.isascii() and (c.isalnum() or c == "-"):
            j = i
            while j < n and gbnf[j].isascii() and (gbnf[j].isalnum() or gbnf[j] == "-"):
                j += 1
            out.append(prefix + gbnf[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def schema_gbnf(schema: Any, param: str, *, relax_unenforced: bool = False) -> str:
    """A JSON schema (an object, or a boolean schema) as GBNF; a 400 naming ``param`` and the
    problem when no value satisfies it, it cannot be enforced (``relax_unenforced``: those
    keywords left out, for tools), or its grammar would be too large (all decided by
    ``check_schema`` before any grammar text is built)."""
    schema = check_schema(schema, param, relax_unenforced=relax_unenforced)
    # Key order kept: the grammar writes properties in the order the schema lists them.
    return _schema_gbnf(json.dumps(schema, separators=(",", ":")), param)


def _tool_schema_gbnf(schema: Any, param: str) -> str:
    """A tool's parameters: keywords no grammar enforces are left out, not refused."""
    return schema_gbnf(schema, param, relax_unenforced=True)


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _schema_gbnf(text: str, param: str) -> str:
    # The converter signals a schema it cannot express with assertions and KeyErrors, and a
    # deeply nested one with RecursionError: each is the schema's problem, said back.
    try:
        gbnf = convert_schema(text)
    except RecursionError:
        raise bad_param(f"{param}: schema nested too deeply", param) from None
    except Exception as exc:  # any converter failure is the schema's problem
        raise bad_param(f"{param}: cannot convert the schema to a grammar: {exc or type(exc).__name__}", param) from None
    # The converter nests a bounded repetition one level per item (maxLength, maxItems).
    if len(gbnf) > MAX_GBNF_CHARS or _nesting(gbnf) > MAX_GBNF_NESTING:
        raise bad_param(
            f"{param}: the schema's grammar is too large (over {MAX_GBNF_CHARS} characters or nested over "
            f"{MAX_GBNF_NESTING} deep: a maxLength or maxItems above {MAX_GBNF_NESTING}?)",
            param,
        )
    return gbnf


def check_gbnf(text: Any, param: str) -> str:
    """GBNF text a request sent (llama-server's ``grammar``), checked for the bounds llama.cpp's
    parser is safe within; its syntax is checked by the compile."""
    if not isinstance(text, str):
        raise bad_param(f"{param} must be a string (GBNF)", param)
    if not text.strip():
        raise bad_param(f"{param} is empty", param)
    if len(text) > MAX_GBNF_CHARS:
        raise bad_param(f"{param} is {len(text)} characters; at most {MAX_GBNF_CHARS}", param)
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
