"""Tool calls' grammar, the template's side: a reply's calls in its ``ToolFormat`` as
llguidance's Lark (each call's arguments its parameters' schema as ``%json``, under the
schema policy: engine/structured/schema_policy.py), and the lazy triggers of ``auto``. Pure.

- ``required``: one or more calls (up to MAX_PARALLEL_CALLS with ``parallel_tool_calls``).
- A named function, or ``parallel_tool_calls: false``: exactly one call.
- ``auto``: a lazy grammar (free text until a trigger), or, beside a typed answer, "the calls
  or a document of the answer's schema" from the first token.
A call whose syntax is a JSON object (hermes, llama3, mistral, the generic form, ...) is
written as the models' own examples space it, ``{"name": "N", "arguments": ARGS}``, its
arguments a ``%json``; where such a reply may open with a JSON answer instead (the generic
form and llama3's bare calls beside a typed answer), the call is one ``%json`` of the call
object, so the choice is between two JSON documents (llguidance reads the first ``{`` as
either; a literal ``{`` beside a ``%json`` one would commit to the literal).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from typing import Any

from ...wire.errors import bad_param
from ..structured import (
    MAX_GRAMMAR_CHARS,
    Constraint,
    OutputGrammar,
    SchemaRules,
    Triggers,
    format_expr,
    format_grammar,
    literal,
    seq,
)
from .families import CALL_PREFIX, ToolFormat, Trigger
from .tools import Tool, ToolRequest

MAX_PARALLEL_CALLS = 8  # calls one reply's tool grammar allows with parallel_tool_calls


# Grammars written lately, by what they are written from: an agent sends the same tools every
# turn, and writing Claude Code's 21 tools' grammar took 10-48 ms (the schema policy's walk and
# checks) before the compiled cache's lookup.
WRITTEN_CACHE_SIZE = 64
_written: OrderedDict[str, OutputGrammar] = OrderedDict()
_written_lock = threading.Lock()  # plans are made on worker threads


def constraint_grammar(constraint: Constraint, fmt: ToolFormat) -> OutputGrammar:
    """The grammar of a request's constraint, tools in the syntax ``fmt`` of the template its
    prompt renders through; a 400 naming the problem."""
    key = json.dumps([repr(fmt), dataclasses.asdict(constraint)], default=repr, sort_keys=True)
    with _written_lock:
        found = _written.get(key)
        if found is not None:
            _written.move_to_end(key)
            return found
    grammar = (
        format_grammar(constraint)
        if constraint.kind != "tools"
        else tools_grammar(constraint.value, fmt, constraint.answer)
    )
    with _written_lock:
        _written[key] = grammar
        while len(_written) > WRITTEN_CACHE_SIZE:
            _written.popitem(last=False)
    return grammar


def tools_grammar(request: ToolRequest, fmt: ToolFormat, answer: Constraint | None = None) -> OutputGrammar:
    """The grammar of a reply's calls in ``fmt`` (``answer``: under ``auto``, the typed answer
    the reply may be instead), and its lazy triggers (``auto`` without an answer)."""
    rules = SchemaRules()  # tool parameters: relaxed, never refused for a keyword
    one = request.choice == "function" or not request.parallel or fmt.one_call
    as_documents = answer is not None and fmt.at_start  # the reply may open with either document
    if fmt.list_key and as_documents:  # the generic form: the calls' whole object is one JSON document
        calls_rule, lines = _json_list(request, fmt, rules, one), []
    else:
        calls_rule, lines = _calls(request, fmt, rules, one, as_documents)
    start = "calls" if answer is None else "calls | answer"
    text = "\n".join([f"start: {start}", f"calls: {calls_rule}", *lines])
    if answer is not None:
        text += f"\nanswer: {format_expr(answer, rules)}"
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad_param(f"tools: the tools' grammar is over {MAX_GRAMMAR_CHARS} characters", "tools")
    triggers: Triggers = ()
    if request.choice == "auto" and answer is None:
        if fmt.tool_patterns is not None:  # patterns of its own, naming the request's tools (functionary)
            triggers = fmt.tool_patterns(fmt, [t.name for t in request.callable])
        else:
            triggers = tuple(t.pattern for t in (*fmt.triggers, *tool_triggers(fmt, request)))
    return OutputGrammar(text, triggers=triggers, param="tools", relaxed=tuple(rules.relaxed), parts=tuple(rules.parts))


def _calls(
    request: ToolRequest, fmt: ToolFormat, rules: SchemaRules, one: bool, as_documents: bool
) -> tuple[str, list[str]]:
    """The calls' expression and the rules it names: before, one call block or more, after
    (``as_documents``: a JSON call is one ``%json`` of its object).

    llguidance lexes a literal greedily: where one alternative's literal is a beginning of
    another's (Hy3's separator ``\n`` and its closing ``\n</tool_calls:opensource>``), it
    commits to the longer, and the other alternative can never be written. So no literal
    stands alone before a choice: each call's leading literal is written together with what
    comes before it (``before`` and ``call_open`` for the first call, ``between`` and
    ``call_open`` for the next ones), and the choice after a call is between whole openings.
    """
    lines: list[str] = []
    first: list[str] = []
    more: list[str] = []
    for i, tool in _callable(request):
        where = f"tools[{i}].function.parameters"
        if fmt.call_rule is not None:  # a family's own call (its module in families/)
            head, rest = _leading_literal(_rule_lines(fmt.call_rule(tool, i, rules), lines))
        elif as_documents:
            head, rest = "", rules.json(_call_object(rules, tool, i, fmt.args_key), where)
        else:
            lines.append(f"args-{i}: {rules(tool.parameters, where)}")
            head, rest = f'{CALL_PREFIX}{tool.name}", "{fmt.args_key}": ', seq(f"args-{i}", literal("}"))
        head, rest = fmt.call_open + head, seq(rest, literal(fmt.call_close))
        lines.append(f"call-{i}: {rest}" if rest else f'call-{i}: ""')
        first.append(seq(literal(fmt.before + head), f"call-{i}"))
        if fmt.before and fmt.before_optional:
            first.append(seq(literal(head), f"call-{i}"))
        more.append(seq(literal(fmt.between + head), f"call-{i}"))
    lines[:0] = [f"first-call: {' | '.join(first)}", f"next-call: {' | '.join(more)}"]
    repeat = "" if one else f" next-call{{0,{MAX_PARALLEL_CALLS - 1}}}"
    return seq(f"first-call{repeat}", literal(fmt.after)), lines


def _rule_lines(rule: tuple[str, list[str]], lines: list[str]) -> str:
    """A family's call rule: its rules into ``lines``, its expression back."""
    expr, more = rule
    lines.extend(more)
    return expr


def _leading_literal(expr: str) -> tuple[str, str]:
    """A call's expression as (its leading literal's text, the rest of it)."""
    if not expr.startswith('"'):
        return "", expr
    text, end = _STRING.raw_decode(expr)
    return text, expr[end:].strip()


_STRING = json.JSONDecoder()


def _json_list(request: ToolRequest, fmt: ToolFormat, rules: SchemaRules, one: bool) -> str:
    """The generic form's reply, ``{"tool_calls": [call, ...]}``, as one JSON document."""
    items = f"#/properties/{fmt.list_key}/items/anyOf"
    options = [
        _call_object(rules, tool, i, fmt.args_key, f"{items}/{k}") for k, (i, tool) in enumerate(_callable(request))
    ]
    calls = {"type": "array", "items": {"anyOf": options}, "minItems": 1, "maxItems": 1 if one else MAX_PARALLEL_CALLS}
    document = {
        "type": "object",
        "properties": {fmt.list_key: calls},
        "required": [fmt.list_key],
        "additionalProperties": False,
    }
    return rules.json(document, "tools")


def _call_object(rules: SchemaRules, tool: Tool, i: int, args_key: str, base: str = "#") -> dict[str, Any]:
    """One call as a JSON object, ``{"name": N, ARGS_KEY: {...}}`` (the arguments' local
    references pointed at where they sit in it)."""
    args = rules.prepared(tool.parameters, f"tools[{i}].function.parameters", ref_base=f"{base}/properties/{args_key}")
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, args_key: args},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _callable(request: ToolRequest) -> list[tuple[int, Tool]]:
    """The tools a reply may call, with their index in the request's list (errors name it)."""
    return [(i, t) for i, t in enumerate(request.tools) if t in request.callable]


def tool_triggers(fmt: ToolFormat, request: ToolRequest) -> tuple[Trigger, ...]:
    """The format's trigger per callable tool (``ToolFormat.tool_trigger``), its name written in."""
    if not fmt.tool_trigger:
        return ()
    text, then = fmt.tool_trigger
    return tuple(
        Trigger(text.replace("{name}", t.name), False, then.replace("{name}", t.name)) for t in request.callable
    )
