"""What the channel dialects share (gpt-oss's harmony, families/harmony.py; Muse Glimmer's
``to=`` messages, families/glimmer.py): a reply of messages, each a header naming its channel
or recipient, then ``<|message|>`` and a body, split into reasoning, content and tool calls,
read back incrementally (any split of a reply gives what the whole reply gives). A dialect's
``ChannelSplitter`` says what ends a body, what a header means and what a body gives. Pure."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Literal

from ..markup import HeldText, NextMark, held_back
from .toolformat import Accept, Props

MESSAGE = "<|message|>"
MAX_HEADER = 512  # characters of a message header before it is taken as text: real ones are short
Kind = Literal["reasoning", "content", "call", "drop"]
Call = tuple[str, str]  # (name, the arguments as written out)


class ChannelSplitter(ABC):
    """Feeds of a reply in a channel dialect -> (reasoning, content, calls) releasable so far.
    ``reasoning``: split the reasoning channel out (else it is content); ``parse_tools``: read
    calls (else their bodies are content); ``accept(name, arguments)``: a call's arguments as
    written out, None when it is not a call (a tool not declared: its body is content);
    ``props_of(name)``: a tool's parameters (typing a dialect's markup values). A dialect says
    what ends a message's body (``ends``; ``next_header``: the end that is the next message's
    header too), what a header means (``_header``) and what a body gives (``_emit``)."""

    ends: tuple[str, ...]
    next_header = ""

    def __init__(
        self, *, reasoning: bool, parse_tools: bool, accept: Accept, props_of: Callable[[str], Props | None]
    ) -> None:
        self._reasoning = reasoning
        self._parse_tools = parse_tools
        self._accept = accept
        self._props_of = props_of
        self._state: Literal["header", "body", "plain"] = "header"
        self._buf = ""
        self._held: HeldText | None = None
        self._ends = NextMark(self.ends)
        self._kind: Kind = "content"
        self._name = ""

    def feed(self, text: str, *, final: bool = False, cut: bool = False) -> tuple[str, str, list[Call]]:
        """``cut``: the length cap ended the reply: a call message it left open (or a header
        not yet through to its message) is dropped, never content."""
        if self._held is not None:  # a call's (or a dropped) body, held whole until it ends
            if not self._held.add(text) and not final:
                return "", "", []
            text, self._held = self._held.text(), None
        buf = self._buf + text
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[Call] = []
        p = 0
        while p < len(buf):
            if self._state == "plain":
                content.append(buf[p:])
                p = len(buf)
            elif self._state == "header":
                k = buf.find(MESSAGE, p, p + MAX_HEADER + len(MESSAGE))
                if k < 0 and len(buf) - p > MAX_HEADER:
                    head = None  # no header is this long: the reply is its text
                else:
                    head = self._header(buf[p:] if k < 0 else buf[p:k], complete=k >= 0)
                if head is None:
                    self._state = "plain"  # not a message header: the reply is its text
                    continue
                if k < 0:
                    if final:
                        if not cut:
                            content.append(buf[p:])  # a header with no message: shown as written
                        p = len(buf)
                    break
                self._kind, self._name = head
                self._state, p = "body", k + len(MESSAGE)
            else:
                hit = self._ends.at(buf, p)
                if hit is not None:
                    j, n = hit
                    self._emit(buf[p:j], reasoning, content, calls, done=True)
                    self._state, p = "header", j if buf[j:j + n] == self.next_header else j + n
                elif final:
                    end = len(buf)
                    if cut:  # a body the cap cut in its end marker: the body without the marker's beginning
                        end -= held_back(buf, p, self.ends)
                    self._emit(buf[p:end], reasoning, content, calls, done=True, cut=cut)
                    p = len(buf)
                elif self._kind in ("call", "drop"):
                    self._held = HeldText(self.ends, buf[p:])  # held whole until it ends
                    p = len(buf)
                    break
                else:
                    keep = held_back(buf, p, self.ends)
                    self._emit(buf[p:len(buf) - keep], reasoning, content, calls, done=False)
                    p = len(buf) - keep
                    break
        self._buf = buf[p:]
        return "".join(reasoning), "".join(content), calls

    @abstractmethod
    def _header(self, head: str, *, complete: bool) -> tuple[Kind, str] | None:
        """What a message with this header is, and its recipient; None: ``head`` is not (the
        start of, unless ``complete``) a header. Incomplete, only that matters."""

    @abstractmethod
    def _emit(
        self, body: str, reasoning: list[str], content: list[str], calls: list[Call], *, done: bool, cut: bool = False
    ) -> None:
        """A body (``done``: the whole of it) into reasoning, content or a call (``cut``: the
        length cap ended it: a call that does not read whole is dropped, never content)."""
