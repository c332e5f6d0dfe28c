"""A lazy grammar's trigger (tool_choice ``auto``): free text until the model starts a call,
then the call grammar from the trigger on. The patterns are written here
(``trigger_pattern``) and watched for in the generated text (``TriggerWatch``); the engine,
not llguidance, decides when the grammar starts, as llama.cpp's lazy grammars do.
"""

from __future__ import annotations

import re

from .grammars import Triggers


def trigger_pattern(text: str, at_start: bool, then: str) -> str:
    """A trigger as a pattern: the literal ``text`` followed by any beginning of ``then``
    (the fixed text the grammar writes right after it), matched at the end of what was
    generated (``at_start``: only as the reply's first non-whitespace text). What the grammar
    is fed from the match on is therefore always a beginning it accepts. (A token that
    carries the trigger and other text leaves the grammar waiting: that reply is
    unconstrained, and its calls are parsed as written.)"""
    body = regex_literal(text) + optional_tail(then)
    return f"^\\s*({body})$" if at_start else f"({body})$"


def optional_tail(text: str) -> str:
    """A regex matching any beginning of ``text`` (the empty one included)."""
    tail = ""
    for c in reversed(text):
        tail = f"(?:{regex_literal(c)}{tail})?"
    return tail


def regex_literal(text: str) -> str:
    """``text`` as a regex matching it (the same in ECMAScript and Python)."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in "\\^$.*+?()[]{}|/" else c for c in text)


class TriggerWatch:
    """Whether a lazy grammar's trigger has appeared in what a request generated, checked
    over a bounded window of the text instead of all of it (a search of the whole reply per
    token made a reply's tokens cost more as it grew, and ``^\\s*(...)$`` over a long run of
    whitespace is quadratic).

    Why a window is enough, for the patterns ``trigger_pattern`` writes (literals and
    optional literal tails, anchored at the end): a match ends at the text's end and is at
    most as long as its pattern, so it lies in the last ``window`` characters; a ``^\\s*``
    pattern also needs everything before the match to be whitespace, which is checked as
    text leaves the window (once anything else leaves, it can never match). The text is
    bytes read as Latin-1 (so a literal's UTF-8 bytes are matched), ``\\s`` ASCII's.
    """

    def __init__(self, patterns: Triggers, max_piece: int) -> None:
        as_bytes = [p.encode().decode("latin-1") for p in patterns]
        self._searches = [re.compile(p[:-1] + r"\Z" if p.endswith("$") else p, re.ASCII) for p in as_bytes]
        self._at_start = [p.startswith("^") for p in as_bytes]
        self._window = max(map(len, as_bytes), default=0) + 2 * max_piece
        self._text = ""  # the last part of the generated text (Latin-1)
        self._only_space = True  # everything that left the window was whitespace
        self.fired = False

    def push(self, piece: bytes) -> bytes | None:
        """Take the next generated token's bytes; when the trigger appears with it, the text
        from where its match starts (what the grammar is fed), else None."""
        self._text += piece.decode("latin-1")
        for search, at_start in zip(self._searches, self._at_start, strict=True):
            if at_start and not self._only_space:
                continue
            found = search.search(self._text)
            if found is not None:
                self.fired = True
                group = next((i for i in range(1, (found.re.groups or 0) + 1) if found.group(i)), 0)
                return self._text[found.start(group):].encode("latin-1")
        if len(self._text) > 2 * self._window:  # trim now and then: amortised O(1) a character
            cut = len(self._text) - self._window
            if self._only_space and self._text[:cut].strip(" \t\n\r\f\v"):
                self._only_space = False
            self._text = self._text[cut:]
        return None
