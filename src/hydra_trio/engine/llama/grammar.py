"""Grammars for constrained decoding: a request's constraint as GBNF text, its compile on the
GPU worker (llama.cpp's grammar sampler), and the bounded cache of compiled grammars.

The request side is pure: ``to_gbnf`` turns a JSON schema (llama-cpp-python's converter,
pure Python), json_object mode (llama.cpp's JSON grammar), GBNF text or a request's tools
(their calls in the template's tool format, with lazy triggers for tool_choice "auto") into
the one GBNF string (and triggers) the parameters carry. ``GrammarCache.compile`` parses it
with llama.cpp once (on the worker) and keeps the parsed grammar as a template; each
request's sampler clones it, so the same schema twice is converted once and parsed once.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import sys
import tempfile
import threading
import weakref
from collections import OrderedDict
from functools import lru_cache
from typing import Any

import llama_cpp
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from ...wire.errors import ParamError, bad_param
from ..params import Constraint
from ..toolcalls import CALL_PREFIX, GENERIC, ToolFormat, Trigger
from ..tools import ToolRequest

MAX_GBNF_CHARS = 256 * 1024  # llama.cpp parses grammars recursively: bound what it is given
# Parentheses deep: llama.cpp's parser recurses once per level and a grammar nested ~100k
# deep overflows the worker's stack (the process dies); 10k parsed fine when measured.
MAX_GBNF_NESTING = 1000
GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept per model
MAX_PARALLEL_CALLS = 8  # calls one reply's tool grammar allows with parallel_tool_calls
_JSON_OBJECT_GBNF = JSON_GBNF.strip() + "\n"


Triggers = tuple[str, ...]  # a lazy grammar's trigger patterns; (): a grammar from the first token


def constraint_gbnf(constraint: Constraint, tool_format: ToolFormat = GENERIC) -> tuple[str, Triggers]:
    """The GBNF a request's output constraint stands for, and its lazy triggers
    (parse_generation's ``to_gbnf``); ``tool_format``: how the chat template writes tool
    calls. Pure Python, on the request's own thread; a 400 naming the problem."""
    if constraint.kind == "json_object":
        return _JSON_OBJECT_GBNF, ()  # any JSON object: llama.cpp's grammars/json.gbnf
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
        schema = schema_gbnf(tool.parameters, f"tools[{i}].function.parameters")
        rules.append(_renamed(schema, f"t{i}-"))
        head = f'{CALL_PREFIX}{tool.name}", "{fmt.args_key}": '
        calls.append(f"{_literal(head)} t{i}-root {_literal('}')}")
    block = " ".join(x for x in (_literal(fmt.call_open), "call", _literal(fmt.call_close)) if x)
    between = _literal(fmt.between)
    more = f" ({between + ' ' if between else ''}call-block){{0,{MAX_PARALLEL_CALLS - 1}}}" if request.parallel else ""
    before = _literal(fmt.before)
    if before and fmt.before_optional:
        before = f"({before})?"
    root = " ".join(x for x in (before, f"call-block{more}", _literal(fmt.after)) if x)
    gbnf = "\n".join([f"root ::= {root}", f"call-block ::= {block}", f"call ::= {' | '.join(calls)}", *rules])
    if len(gbnf) > MAX_GBNF_CHARS:
        raise bad_param(f"tools: the tools' grammar is over {MAX_GBNF_CHARS} characters", "tools")
    triggers = tuple(trigger_pattern(t) for t in fmt.triggers) if request.choice == "auto" else ()
    return gbnf, triggers


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
    tail = ""
    for c in reversed(trigger.then):
        tail = f"(?:{_regex_literal(c)}{tail})?"
    body = _regex_literal(trigger.text) + tail
    return f"^\\s*({body})$" if trigger.at_start else f"({body})$"


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


def schema_gbnf(schema: Any, param: str) -> str:
    """A JSON schema (an object, or a boolean schema) as GBNF; a 400 naming ``param`` and the
    problem when it cannot be converted."""
    if not isinstance(schema, dict | bool):
        raise bad_param(f"{param} must be a JSON schema (an object)", param)
    try:
        schema = _honourable(schema, param)
    except RecursionError:
        raise bad_param(f"{param}: schema nested too deeply", param) from None
    # Key order kept: the grammar writes properties in the order the schema lists them.
    return _schema_gbnf(json.dumps(schema, separators=(",", ":")), param)


# Keywords that assert something the converter (llama-cpp-python's) does not build into the
# grammar: refused, since a reply would then not be valid for the schema. Annotations
# (title, description, default, format, ...) constrain nothing and pass.
_UNENFORCED = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems",
    "minProperties", "maxProperties", "patternProperties", "propertyNames", "not", "if", "then",
    "else", "dependentRequired", "dependentSchemas", "dependencies", "contains", "minContains",
    "maxContains", "unevaluatedProperties", "unevaluatedItems", "additionalItems",
})
_CONVERTER_CHAR, _JSON_CHAR = r'char ::= [^"\\] |', r'char ::= [^"\\\x7F\x00-\x1F] |'
_CONVERTER_DOT, _JSON_DOT = r"dot ::= [^\x0A\x0D]", r"dot ::= [^\x00-\x1F\x7F]"
# The converter's exponent takes 16 digits: 1e548 is JSON text, but no float (Python reads it
# as inf, strict JSON refuses it, and a tool call's arguments could not be written back).
# Two digits keep every number the grammar allows finite (16-digit mantissa, e99 at most).
_CONVERTER_EXP, _FINITE_EXP = "([eE] [-+]? integral-part)?", "([eE] [-+]? [0-9] [0-9]?)?"
MAX_INT_RANGE = 256  # a closed integer range up to this many values becomes an enum


def _honourable(schema: Any, param: str) -> Any:
    """``schema`` with what the converter cannot enforce made enforceable (a small closed
    integer range: an enum of its values) or refused, naming the keyword."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if out.get("type") == "integer" and _UNENFORCED.intersection(out) <= {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}:
        lo, hi = _int_bounds(out)
        if lo is not None and hi is not None and 0 < hi - lo + 1 <= MAX_INT_RANGE:
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "type"):
                out.pop(key, None)
            out["enum"] = list(range(lo, hi + 1))
    bad = sorted(_UNENFORCED.intersection(out))
    if bad:
        hint = f" (integers: a closed range of at most {MAX_INT_RANGE} values is)" if set(bad) & {"minimum", "maximum"} else ""
        raise bad_param(f"{param}: the schema keyword {bad[0]!r} is not supported in constrained output{hint}", param)
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {k: _honourable(v, param) for k, v in out[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = _honourable(out[key], param)
    for key in ("items", "prefixItems", "anyOf", "oneOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [_honourable(v, param) for v in out[key]]
    return out


def _int_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """An integer schema's inclusive bounds (None: unbounded or not an integer bound)."""
    def num(key: str) -> float | None:
        v = schema.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    lo, hi = num("minimum"), num("maximum")
    if (x := num("exclusiveMinimum")) is not None:
        lo = max(lo, math.floor(x) + 1) if lo is not None else math.floor(x) + 1
    if (x := num("exclusiveMaximum")) is not None:
        hi = min(hi, math.ceil(x) - 1) if hi is not None else math.ceil(x) - 1
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return None, None
    return math.ceil(lo), math.floor(hi)


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _schema_gbnf(text: str, param: str) -> str:
    # The converter signals a schema it cannot express with assertions and KeyErrors, and a
    # deeply nested one with RecursionError: each is the schema's problem, said back.
    try:
        gbnf = json_schema_to_gbnf(text)
    except RecursionError:
        raise bad_param(f"{param}: schema nested too deeply", param) from None
    except Exception as exc:  # any converter failure is the schema's problem
        raise bad_param(f"{param}: cannot convert the schema to a grammar: {exc or type(exc).__name__}", param) from None
    # This converter's string characters admit raw control characters, which JSON forbids in
    # a string (llama.cpp's own converter and json.gbnf exclude them): excluded here too.
    gbnf = gbnf.replace(_CONVERTER_CHAR, _JSON_CHAR).replace(_CONVERTER_DOT, _JSON_DOT).replace(_CONVERTER_EXP, _FINITE_EXP)
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


class GrammarError(ParamError):
    """A grammar llama.cpp could not parse: a 400 naming its problem."""


class GrammarCache:
    """Compiled grammars of one model's vocabulary, most recently used kept (a bounded LRU
    keyed by the GBNF text and the lazy triggers). ``compile`` and ``new_state`` run on the
    GPU worker only; ``known`` may be asked from any thread (one dict lookup)."""

    def __init__(self, vocab: Any, pieces: list[bytes], capacity: int = GRAMMAR_CACHE_SIZE) -> None:
        self._vocab = vocab
        self.pieces = pieces  # each token's bytes: constrained text is also kept valid UTF-8
        self._capacity = capacity
        self._templates: OrderedDict[tuple[str, Triggers], _Template] = OrderedDict()
        self.compiles = 0  # llama.cpp parses done (a test counts them)

    def known(self, gbnf: str, triggers: Triggers = ()) -> bool:
        return (gbnf, triggers) in self._templates

    def compile(self, gbnf: str, param: str = "grammar", triggers: Triggers = ()) -> None:
        """Parse ``gbnf`` with llama.cpp and keep it; a GrammarError naming what llama.cpp
        said when it cannot parse it. ``triggers``: a lazy grammar's patterns
        (``trigger_pattern``). Worker only."""
        self._template(gbnf, triggers, param)

    def new_state(self, gbnf: str, triggers: Triggers = ()) -> llama_cpp.llama_sampler_p:
        """A fresh grammar sampler for one request (the caller frees it). Worker only."""
        state = llama_cpp.llama_sampler_clone(self._template(gbnf, triggers, "grammar").ptr)
        if not state:
            raise RuntimeError("llama.cpp could not clone a grammar sampler")
        return state

    def _template(self, gbnf: str, triggers: Triggers, param: str) -> _Template:
        key = (gbnf, triggers)
        template = self._templates.get(key)
        if template is not None:
            self._templates.move_to_end(key)
            return template
        ptr, said = _with_stderr(lambda: self._init(gbnf, triggers), gbnf)
        self.compiles += 1
        if not ptr:
            raise GrammarError(f"{param}: llama.cpp cannot parse the grammar: {_problem(said)}", param)
        template = _Template(ptr)
        self._templates[key] = template
        while len(self._templates) > self._capacity:
            self._templates.popitem(last=False)  # freed once no sampler still clones from it
        return template

    def _init(self, gbnf: str, triggers: Triggers) -> llama_cpp.llama_sampler_p:
        if not triggers:
            return llama_cpp.llama_sampler_init_grammar(self._vocab, gbnf.encode(), b"root")
        # Lazy: the grammar passes every token until a pattern matches (llama.cpp compiles
        # each as a std::regex; ours come from trigger_pattern only, never from a request).
        patterns = (ctypes.c_char_p * len(triggers))(*(t.encode() for t in triggers))
        return llama_cpp.llama_sampler_init_grammar_lazy_patterns(
            self._vocab, gbnf.encode(), b"root", patterns, len(triggers), None, 0
        )


class _Template:
    """A parsed grammar sampler, freed when the last reference goes (a request that looked
    it up may clone it after the cache dropped it)."""

    def __init__(self, ptr: llama_cpp.llama_sampler_p) -> None:
        self.ptr = ptr
        weakref.finalize(self, llama_cpp.llama_sampler_free, ptr)


def _problem(said: str) -> str:
    """The line of llama.cpp's output that names the problem."""
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    for line in lines:
        if "error parsing grammar:" in line:
            return line.split("error parsing grammar:", 1)[1].strip()
    for line in lines:
        if "grammar" in line and line != "failed to parse grammar":
            return line
    return "syntax error"


_stderr_lock = threading.Lock()


def _with_stderr(fn: Any, gbnf: str) -> tuple[Any, str]:
    """Run a llama call and return what it printed: the grammar parser writes its errors to
    fd 2 (fprintf), not through llama's log callback. The client is told the problem (a 400),
    so the parser's report (with the grammar echoed) is not printed; anything else printed
    meanwhile, by any thread, is written back to stderr."""
    from .log import captured

    with _stderr_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            try:
                result, lines = captured(fn)
            finally:
                os.dup2(saved, 2)
        finally:
            os.close(saved)
        tmp.seek(0)
        printed = tmp.read().decode("utf-8", "replace")
    rest = [
        line
        for line in printed.replace(gbnf, "").splitlines(keepends=True)
        if line.strip() and "parsing grammar" not in line and "failed to parse grammar" not in line
    ]
    if rest:
        sys.stderr.write("".join(rest))
    return result, printed + "".join(lines)
