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
import json.decoder
import json.scanner
import math
import re
from collections.abc import Generator
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


_STRICT = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def parse_json(data: Buffer, what: str) -> Any:
    """Any strict JSON value; every failure is BAD_JSON, its message naming ``what``."""
    try:
        # str() of the buffer is the one copy json needs (bytes() then decode would be two).
        text = str(data, "utf-8")
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        # ValueError: bad UTF-8, bad syntax, the constants above, an integer past Python's
        # 4,300-digit conversion limit; RecursionError: nesting past the parser's depth.
        raise ProtocolError(ErrorCode.BAD_JSON, f"{what}: invalid JSON: {exc}") from None
    _refuse_lone_surrogates(text, value, what)
    return value


# A ``\uD800``-``\uDFFF`` escape: JSON's grammar lets one stand alone, and json reads it as a
# lone surrogate, which is no Unicode text: it failed wherever the text was encoded again (a
# reply, a schema's grammar, the tokenizer: 500s the dialect fuzz found). Refused on input.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _refuse_lone_surrogates(text: str, value: Any, what: str) -> None:
    """BAD_JSON when a string or key of ``value`` holds a lone surrogate (looked for only in a
    text that spells a surrogate escape: a pair, as emoji are escaped, is one character)."""
    if not _SURROGATE_ESCAPE.search(text):
        return
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            strings: list[Any] = [item]
        elif isinstance(item, dict):
            strings = list(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
            continue
        else:
            continue
        for string in strings:
            try:
                string.encode("utf-8")
            except UnicodeEncodeError:
                raise ProtocolError(
                    ErrorCode.BAD_JSON, f"{what}: a string holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape "
                    "without its pair): not Unicode text"
                ) from None


def parse_json_object(data: Buffer, what: str) -> dict[str, Any]:
    """A strict JSON object (``parse_json``); any other value is BAD_JSON."""
    value = parse_json(data, what)
    if not isinstance(value, dict):
        raise ProtocolError(ErrorCode.BAD_JSON, f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


# A body past this many characters is parsed in slices (``parse_json_sliced``): json's C parser
# holds the GIL for its whole call (a 13 MB body of tiny objects: ~1 s, every stream waiting).
SLICED_MIN_CHARS = 256 << 10
SLICE_CHARS = 32 << 10  # text read between two yields: a few ms of object building
# As deep as json's C parser goes on the thread's stack (its RecursionError, a 400): deeper
# values would raise where they are walked again (templates, schemas, replies).
MAX_BODY_DEPTH = 900
_SPACE = re.compile(r"[ \t\n\r]*")
_SCAN = json.scanner.c_make_scanner(_STRICT) if json.scanner.c_make_scanner else json.scanner.py_make_scanner(_STRICT)
_SCAN_STRING = json.decoder.c_scanstring or json.decoder.py_scanstring


def parse_json_sliced(text: str, what: str) -> Generator[None, None, Any]:
    """``parse_json`` of ``text`` (by the same rules: strict numbers, objects' last duplicate
    key wins), in slices: a generator that yields after each ``SLICE_CHARS`` of text and
    returns the value, so its caller can let others run between slices. json's C scanner
    reads each piece whose work is bounded: a container that closes within a window of text
    (256, 4,096 or 32,768 characters), or a run of a walked container's members up to a comma
    within a window (read as a container of its own: it parses only if that comma is the
    container's own). Containers past that are walked here, without recursion. BAD_JSON for
    anything that is not JSON."""
    try:
        value = yield from _sliced(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.BAD_JSON, f"{what}: invalid JSON: {exc}") from None
    _refuse_lone_surrogates(text, value, what)
    return value


_WINDOWS = (256, 4096, SLICE_CHARS)
_WALKED_DEPTH = 64  # deeper, containers are walked (a window's C parse recurses on the stack)


def _scan_at(text: str, i: int) -> tuple[Any, int]:
    try:
        return _SCAN(text, i)
    except StopIteration:  # (inside a generator it must not leave as itself)
        raise ValueError(f"expecting a value at character {i}") from None


def _window(text: str, i: int, work: list[int]) -> tuple[Any, int] | None:
    """The container at ``text[i]`` by the C scanner when it closes within a window: its
    work bounded by the window, not the container (whose end is not known yet). ``work``
    counts the characters read, those of windows tried in vain too."""
    for w in _WINDOWS:
        work[0] += w
        if i + w >= len(text):
            return _scan_at(text, i)
        try:
            value, end = _SCAN(text[i:i + w], 0)
        except (StopIteration, ValueError, RecursionError):
            continue  # not closed within the window (or not JSON: the walk will say where)
        return value, i + end
    return None


def _run(text: str, i: int, is_object: bool, work: list[int]) -> tuple[Any, int] | None:
    """Members of a walked container from ``text[i]`` up to a comma within a window, read as
    one container of their own: (them, that comma's place), or None when no comma there is
    this container's own (one inside a string or a nested value does not parse). The commas
    tried: the window's last, and its last after a closing bracket (between objects)."""
    end = i + SLICE_CHARS
    for k in dict.fromkeys((text.rfind(",", i, end), max(text.rfind("},", i, end), text.rfind("],", i, end)) + 1)):
        if k <= i:
            continue
        work[0] += k - i
        try:
            value, stop = _SCAN(("{" if is_object else "[") + text[i:k] + ("}" if is_object else "]"), 0)
        except (StopIteration, ValueError, RecursionError):
            continue
        if stop == k - i + 2:
            return value, k
    return None


def _sliced(text: str) -> Generator[None, None, Any]:
    n, work = len(text), [0]  # characters read since the last yield
    stack: list[list[Any]] = []  # [container, key of the member being read (objects), where a run may be tried]
    keys: dict[str, str] = {}  # one string per distinct key, as json's own memo
    space = _SPACE.match

    def key_at(i: int) -> tuple[str, int]:
        if not text.startswith('"', i):
            raise ValueError(f"expecting a property name in double quotes at character {i}")
        key, i = _SCAN_STRING(text, i + 1, True)
        i = space(text, i).end()  # type: ignore[union-attr]
        if not text.startswith(":", i):
            raise ValueError(f"expecting ':' at character {i}")
        return keys.setdefault(key, key), space(text, i + 1).end()  # type: ignore[union-attr]

    i = space(text, 0).end()  # type: ignore[union-attr]
    members = False  # at a walked container's next member (else at a value)
    while True:
        if members:  # a run of members by the C scanner, else the next one's key (objects)
            frame = stack[-1]
            is_object = isinstance(frame[0], dict)
            run = _run(text, i, is_object, work) if len(stack) < _WALKED_DEPTH and i >= frame[2] else None
            if run is not None:
                part, i = run
                frame[0].update(part) if is_object else frame[0].extend(part)
                value = None
            else:
                frame[2] = i + SLICE_CHARS  # no run here: member by member until past this window
                if is_object:
                    frame[1], i = key_at(i)
        if not members or run is None:
            c = text[i:i + 1]
            read = _window(text, i, work) if c in ("{", "[") and len(stack) < _WALKED_DEPTH else None
            if read is not None:
                value, i = read
            elif c in ("{", "["):  # walked: its members next, or it is empty
                if len(stack) >= MAX_BODY_DEPTH:
                    raise ValueError(f"nested deeper than {MAX_BODY_DEPTH}")
                i = space(text, i + 1).end()  # type: ignore[union-attr]
                if not text.startswith("}" if c == "{" else "]", i):
                    stack.append([{} if c == "{" else [], None, i])
                    members = True
                    continue
                value, i = ({} if c == "{" else []), i + 1
            else:
                value, i = _scan_at(text, i)
        work[0] += 16  # a walked member's own steps
        members, run_done = False, members and run is not None
        while True:  # a value is whole: into its container, then that one's next member or end
            if not stack:
                i = space(text, i).end()  # type: ignore[union-attr]
                if i != n:
                    raise ValueError(f"extra data at character {i}")
                return value
            frame = stack[-1]
            if not run_done:
                if frame[1] is None:
                    frame[0].append(value)
                else:
                    frame[0][frame[1]] = value
            run_done = False
            i = space(text, i).end()  # type: ignore[union-attr]
            if text.startswith(",", i):
                i = space(text, i + 1).end()  # type: ignore[union-attr]
                members = True
                break
            if not text.startswith("}" if isinstance(frame[0], dict) else "]", i):
                raise ValueError(f"expecting ',' or a closing bracket at character {i}")
            value, i = frame[0], i + 1
            stack.pop()
        if work[0] >= SLICE_CHARS:
            work[0] = 0
            yield


# The deepest a JSON value a model wrote may nest: no tool's arguments need more, and it keeps
# every later reading and writing of them (json's C code recurses) far from Python's limit.
MAX_MODEL_DEPTH = 100

_STRUCTURE = re.compile(r'["\[\]{}]')  # what changes the nesting outside a string
_IN_STRING = re.compile(r'["\\]')  # what ends a string or escapes its next character
_NON_SPACE = re.compile(r"\S")


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


__all__ = [
    "MAX_MODEL_DEPTH",
    "SLICED_MIN_CHARS",
    "JsonSpan",
    "parse_json",
    "parse_json_object",
    "parse_json_sliced",
    "read_bounded",
    "read_bounded_at",
]
