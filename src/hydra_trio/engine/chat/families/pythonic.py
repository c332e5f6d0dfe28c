"""Python-style tool calls, ``[name(arg="v", n=1), other()]``: LFM2's and LFM2.5's syntax
(between ``<|tool_call_start|>`` and ``<|tool_call_end|>``): the reader (Python and JSON
literals, as llama.cpp's common/parsers/lfm2.cpp reads them) and the call rule (keyword
arguments in the schema's order). Pure."""

from __future__ import annotations

import ast
import json
import re
import warnings
from collections.abc import Callable
from typing import Any

from ....wire.jsontext import MAX_MODEL_DEPTH
from ...structured import SchemaExpr, literal, seq
from ..tools import Tool
from .roster import register
from .toolformat import Block, Call, Detect, Props, ToolFormat, Trigger

# -- LFM2 / LFM2.5: <|tool_call_start|>[name(arg="v", n=1), other()]<|tool_call_end|> (Python-style calls)

_PY_NAME = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*\(")
_PY_KEY = re.compile(r"\s*([^\s=,()\[\]{}'\"]+)\s*=")
_PY_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_PY_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', re.S)
_PY_WORDS = re.compile(r"True|False|None|true|false|null")
_PY_WORD_VALUES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def _py_string(token: str) -> str:
    """A quoted literal's text: a double-quoted one as JSON when it is JSON (its ``\\u``
    surrogate pairs joined), else by Python's escapes."""
    if token[0] == '"':
        try:
            value = json.loads(token)
        except ValueError:
            pass
        else:
            return value if isinstance(value, str) else token
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = ast.literal_eval(token)  # a string literal only: the token is one
    return value.encode("utf-16", "surrogatepass").decode("utf-16", "surrogatepass")


class _PyReader:
    """The Python-literal subset LFM2 writes its calls in (and JSON's literals, as llama.cpp
    accepts them): calls with keyword arguments, strings, numbers, lists, tuples, dicts."""

    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0
        self._depth = 0  # lists, tuples and dicts open around the value being read

    def _ws(self) -> None:
        while self.i < len(self.text) and self.text[self.i].isspace():
            self.i += 1

    def _take(self, c: str) -> bool:
        self._ws()
        if self.text.startswith(c, self.i):
            self.i += len(c)
            return True
        return False

    def _match(self, pattern: re.Pattern[str]) -> re.Match[str] | None:
        self._ws()
        m = pattern.match(self.text, self.i)
        if m is not None:
            self.i = m.end()
        return m

    def calls(self) -> list[Call]:
        if not self._take("["):
            raise ValueError("no list")
        calls: list[Call] = []
        while True:
            m = self._match(_PY_NAME)
            if m is None:
                raise ValueError("no call")
            args: dict[str, Any] = {}
            while not self._take(")"):
                if args and not self._take(","):
                    raise ValueError("no comma")
                if self._take(")"):  # a trailing comma
                    break
                key = self._match(_PY_KEY)
                if key is None:
                    raise ValueError("no keyword")
                args[key.group(1)] = self.value()
            calls.append((m.group(1), args, None))
            if self._take("]"):
                break
            if not self._take(","):
                raise ValueError("no comma")
        self._ws()
        if self.i != len(self.text):
            raise ValueError("text after the calls")
        return calls

    def value(self) -> Any:
        self._ws()
        c = self.text[self.i:self.i + 1]
        if c in ("'", '"'):
            m = self._match(_PY_STRING)
            if m is None:
                raise ValueError("unterminated string")
            return _py_string(m.group(0))
        if c in ("[", "(", "{"):
            self._depth += 1
            if self._depth > MAX_MODEL_DEPTH:  # as JSON a model wrote (wire/jsontext.py)
                raise ValueError("nested too deep")
            value = self._nested(c)
            self._depth -= 1
            return value
        if (w := self._match(_PY_WORDS)) is not None:
            return _PY_WORD_VALUES[w.group(0)]
        if (n := self._match(_PY_NUMBER)) is not None:
            text = n.group(0)
            return float(text) if any(x in text for x in ".eE") else int(text)
        raise ValueError("no value")

    def _nested(self, c: str) -> Any:
        """The list, tuple or dict that ``c`` opens."""
        if c in ("[", "("):
            close = "]" if c == "[" else ")"
            self.i += 1
            items: list[Any] = []
            while not self._take(close):
                if items and not self._take(","):
                    raise ValueError("no comma")
                if self._take(close):
                    break
                items.append(self.value())
            return items
        self.i += 1
        obj: dict[str, Any] = {}
        while not self._take("}"):
            if obj and not self._take(","):
                raise ValueError("no comma")
            if self._take("}"):
                break
            key = self.value()
            if not isinstance(key, str) or not self._take(":"):
                raise ValueError("bad key")
            obj[key] = self.value()
        return obj


def pythonic_calls(body: str) -> list[Call] | None:
    """``[name(k=v, ...), ...]`` as calls; None when it is not that."""
    try:
        return _PyReader(body).calls()
    except (ValueError, SyntaxError, MemoryError):
        return None


def _read_lfm2(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    return pythonic_calls(body)


def _keyword_rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
    """``NAME(k1=V1, k2=V2)``: the schema's properties in order as keyword arguments (required
    ones always, others optional, a comma between two), each value its schema's JSON."""
    props = tool.parameters.get("properties") if isinstance(tool.parameters, dict) else None
    required = set(tool.parameters.get("required") or ()) if isinstance(tool.parameters, dict) else set()
    items = list((props or {}).items())
    rules: list[str] = []
    values: list[str] = []
    for j, (key, prop) in enumerate(items):
        rules.append(f"t{i}-p{j}: {schema(prop, f'tools[{i}].function.parameters.properties.{key}')}")
        values.append(seq(literal(key + "="), f"t{i}-p{j}"))
    n = len(items)
    # t{i}-more{j}: the arguments from j on after one was written; t{i}-args{j}: none yet.
    for j in range(n - 1, -1, -1):
        more_next = f"t{i}-more{j + 1}" if j + 1 < n else ""
        args_next = f"t{i}-args{j + 1}" if j + 1 < n else ""
        this = seq(literal(", "), values[j], more_next)
        first = seq(values[j], more_next)
        if items[j][0] in required:
            rules.append(f"t{i}-more{j}: {this}")
            rules.append(f"t{i}-args{j}: {first}")
        else:
            rules.append(f"t{i}-more{j}: ({this})" + (f" | {more_next}" if more_next else "?"))
            rules.append(f"t{i}-args{j}: ({first})" + (f" | {args_next}" if args_next else "?"))
    return seq(literal(tool.name + "("), f"t{i}-args0" if n else "", literal(")")), rules


LFM2 = register(ToolFormat(
    "lfm2",
    "arguments",
    before="<|tool_call_start|>[",
    between=", ",
    after="]<|tool_call_end|>",
    block=Block(openers=("<|tool_call_start|>",), closer="<|tool_call_end|>", read=_read_lfm2, call_end=")",
                list_close="]"),
    call_rule=_keyword_rule,
    triggers=(Trigger("<|tool_call_start|>", False, "["),),
    detect=(
        Detect(120, ("<|tool_list_start|>", "<|tool_list_end|>")),  # LFM2 (llama.cpp's is_lfm2_template)
        Detect(130, ("List of tools: [",)),  # LFM2.5: its tools in plain text
    ),
))
