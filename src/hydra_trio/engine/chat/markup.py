"""Reading the markup in a model's reply, the primitives every reply reader shares, each
linear in its text and bounded however the text is split or nested: where a mark may begin at
a piece's end (``partial_suffix``, ``held_back``), where the next of some marks is
(``NextMark``), text held until a mark comes (``HeldText``), tagged elements one after another
(``elements``), and values as a family writes them: JSON read within its nesting bound
(``json_args``, ``json_items``; wire/jsontext.py), or an XML parameter's text (``typed_value``).

No reader here scans on from each place a pattern failed at (a regex ``finditer`` whose match
must start where the last ended, or one with a lazy ``(.*?)`` before ``\\s*`` and a mark,
does): each lookup starts where the last one ended. Pure."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ...wire.jsontext import read_bounded

NON_SPACE = re.compile(r"\S")


def partial_suffix(text: str, *marks: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of one of
    ``marks``: what must be held back because the next piece may complete the mark."""
    best = 0
    for mark in marks:
        for n in range(min(len(mark) - 1, len(text)), best, -1):
            if text.endswith(mark[:n]):
                best = n
                break
    return best


def held_back(text: str, start: int, marks: tuple[str, ...]) -> int:
    """``partial_suffix`` of ``text[start:]``, looking at its last few characters only."""
    longest = max(map(len, marks))
    return partial_suffix(text[max(start, len(text) - longest):], *marks)


class NextMark:
    """Where the next of some marks occurs in the text being read: searched once per stretch
    (a reading only moves forward), so that looking for a mark that never comes, again after
    each of many others, is not a pass over the rest of the text each time."""

    def __init__(self, marks: tuple[str, ...]) -> None:
        # Shortest first: of marks at one place, the shortest is the one found.
        self._re = re.compile("|".join(re.escape(m) for m in sorted(marks, key=len))) if marks else None
        self._text: str | None = None
        self._from = 0
        self._hit: tuple[int, int] | None = None

    def at(self, text: str, pos: int) -> tuple[int, int] | None:
        """(place, length) of the first mark at or after ``pos`` in ``text``, or None."""
        if self._re is None:
            return None
        if text is not self._text or pos < self._from or (self._hit is not None and self._hit[0] < pos):
            m = self._re.search(text, pos)
            self._text, self._from, self._hit = text, pos, None if m is None else (m.start(), m.end() - m.start())
        return self._hit


class HeldText:
    """Text held back whole until one of some marks appears in it (a call's body): pieces are
    kept as they come and each is looked at once, with the few characters before it where a
    mark may have begun, so holding N characters costs N, not N per piece."""

    def __init__(self, marks: tuple[str, ...], text: str) -> None:
        self._marks = marks
        self._keep = max(map(len, marks)) - 1
        self._parts = [text]
        self._tail = text[len(text) - self._keep:] if self._keep else ""

    def add(self, text: str) -> bool:
        """Hold ``text`` too; whether a mark has appeared."""
        if not text:
            return False
        self._parts.append(text)
        seen = self._tail + text
        self._tail = seen[len(seen) - self._keep:] if self._keep else ""
        return any(m in seen for m in self._marks)

    def text(self) -> str:
        return "".join(self._parts)


def json_args(text: str) -> dict[str, Any] | None:
    try:
        value = read_bounded(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def json_items(text: str) -> list[Any] | None:
    """A non-empty JSON list (a family's calls), else None."""
    try:
        value = read_bounded(text)
    except ValueError:
        return None
    return value if isinstance(value, list) and value else None


def elements(text: str, opener: str, sep: str, closer: str) -> list[tuple[str, str]] | None:
    """``OPENER head SEP value CLOSER``, one after another with only whitespace between:
    (head, value) of each (each up to the first SEP, the first CLOSER); None for any other text."""
    out: list[tuple[str, str]] = []
    pos = 0
    while (m := NON_SPACE.search(text, pos)) is not None:
        if not text.startswith(opener, m.start()):
            return None
        head = m.start() + len(opener)
        s = text.find(sep, head)
        e = text.find(closer, s + len(sep)) if s >= 0 else -1
        if e < 0:
            return None
        out.append((text[head:s], text[s + len(sep):e]))
        pos = e + len(closer)
    return out


def trim_nl(text: str) -> str:
    """A parameter's value without the one newline each side the XML forms put around it."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    return text


def typed_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """An XML parameter's text as the argument's value: as written for a string parameter
    (or one the tool does not declare as another type); else its JSON value, the text when
    it is not JSON (as llama.cpp's XML parsers do)."""
    kind = schema.get("type") if schema is not None else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
        return text
    try:
        return read_bounded(text)
    except ValueError:
        return text


def xml_args(pairs: list[tuple[str, str]], props: Mapping[str, Mapping[str, Any]] | None) -> dict[str, Any]:
    return {k: typed_value(trim_nl(v), (props or {}).get(k)) for k, v in pairs}


def object_args(value: Any) -> dict[str, Any] | None:
    """A call's arguments: an object, or (as templates that print them ``| tojson`` show a
    string's) a JSON string of one."""
    if isinstance(value, str):
        return json_args(value)
    return value if isinstance(value, dict) else None
