"""Strict JSON text: the one rule for every JSON that comes in (HTTP bodies, RPC payloads and
reply metas, DECODE frames, KV_PULL requests).

UTF-8 without a byte-order mark (RFC 8259 §8.1), and numbers only: ``NaN``, ``Infinity`` and a
number past a float's range (``1e999``, which Python would read as inf) are refused. None of
them is JSON, and none could be written back out as JSON (an error reply or a log line that
echoes a value, a kv_transfer_params passed on). What a client's JSON library writes
(OpenAI's SDKs: httpx ``allow_nan=False``, JavaScript's ``JSON.stringify``) is always finite.

JSON a model wrote (tool-call arguments, a family's list of calls) is read by the same rule
and within a nesting bound (``read_bounded``, ``read_bounded_at``): a reply nested ~1,000 deep
would raise RecursionError in json's C parser, and one that parsed would raise it again where
the reply is written out. ``JsonSpan`` finds where such a value ends, incrementally.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from .errors import ErrorCode, ProtocolError

Buffer = bytes | bytearray | memoryview


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def parse_json(data: Buffer, what: str) -> Any:
    """Any strict JSON value; every failure is BAD_JSON, its message naming ``what``."""
    try:
        # str() of the buffer is the one copy json needs (bytes() then decode would be two).
        return json.loads(str(data, "utf-8"), parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        # ValueError: bad UTF-8, bad syntax, the constants above, an integer past Python's
        # 4,300-digit conversion limit; RecursionError: nesting past the parser's depth.
        raise ProtocolError(ErrorCode.BAD_JSON, f"{what}: invalid JSON: {exc}") from None


def parse_json_object(data: Buffer, what: str) -> dict[str, Any]:
    """A strict JSON object (``parse_json``); any other value is BAD_JSON."""
    value = parse_json(data, what)
    if not isinstance(value, dict):
        raise ProtocolError(ErrorCode.BAD_JSON, f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


# The deepest a JSON value a model wrote may nest: no tool's arguments need more, and it keeps
# every later reading and writing of them (json's C code recurses) far from Python's limit.
MAX_MODEL_DEPTH = 100

_STRUCTURE = re.compile(r'["\[\]{}]')  # what changes the nesting outside a string
_IN_STRING = re.compile(r'["\\]')  # what ends a string or escapes its next character
_NON_SPACE = re.compile(r"\S")
_STRICT = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


class JsonSpan:
    """Where a JSON object or array ends and how deep it nests, read in pieces as they come:
    each ``feed`` looks at the new text only, jumping (in C) to the characters that matter,
    so a value streamed in any number of pieces is read once. Offsets count from the first
    character fed, which opens the value."""

    __slots__ = ("_escape", "_string", "deepest", "depth", "end", "fed")

    def __init__(self) -> None:
        self.depth = 0
        self.deepest = 0
        self.fed = 0  # characters read so far
        self.end: int | None = None  # just past the value's last character, once read
        self._string = False
        self._escape = False

    def feed(self, text: str, start: int = 0) -> int | None:
        """Read ``text[start:]``, what follows what was fed; the end once it is known."""
        if self.end is not None:
            return self.end
        base, i, n = self.fed - start, start, len(text)
        while i < n:
            if self._escape:
                self._escape, i = False, i + 1
            elif self._string:
                m = _IN_STRING.search(text, i)
                if m is None:
                    break
                i = m.end()
                if m.group() == "\\":
                    self._escape = True
                else:
                    self._string = False
            else:
                m = _STRUCTURE.search(text, i)
                if m is None:
                    break
                i, c = m.end(), m.group()
                if c == '"':
                    self._string = True
                elif c in "[{":
                    self.depth += 1
                    self.deepest = max(self.deepest, self.depth)
                else:
                    self.depth -= 1
                    if self.depth <= 0:
                        self.end = self.fed = base + i
                        return self.end
        self.fed = base + n
        return None


def read_bounded_at(text: str, pos: int, max_depth: int = MAX_MODEL_DEPTH) -> tuple[Any, int]:
    """(value, end) of the strict JSON value at ``text[pos]`` (json's ``raw_decode``), nested
    at most ``max_depth``; ValueError for anything else. Looks at the value's own text only."""
    if text.startswith(("{", "["), pos):
        span = JsonSpan()
        end = span.feed(text, pos)
        if end is None:
            raise ValueError("unterminated JSON value")
        if span.deepest > max_depth:
            raise ValueError(f"JSON nested deeper than {max_depth}")
    try:
        return _STRICT.raw_decode(text, pos)
    except RecursionError:  # not reached within the bound; never a crash if it were
        raise ValueError("JSON nested too deep") from None


def read_bounded(text: str, max_depth: int = MAX_MODEL_DEPTH) -> Any:
    """The strict JSON value ``text`` is (whitespace around it allowed), nested at most
    ``max_depth``; ValueError for anything else."""
    m = _NON_SPACE.search(text)
    if m is None:
        raise ValueError("no JSON value")
    value, end = read_bounded_at(text, m.start(), max_depth)
    if _NON_SPACE.search(text, end):
        raise ValueError("text after the JSON value")
    return value


__all__ = ["MAX_MODEL_DEPTH", "JsonSpan", "parse_json", "parse_json_object", "read_bounded", "read_bounded_at"]
