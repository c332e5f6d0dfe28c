"""The channel dialects, read back incrementally (any split of a reply gives what the whole
reply gives): a reply of messages, each a header naming its channel or recipient, then
``<|message|>`` and a body, split into reasoning, content and tool calls. Pure.

gpt-oss's harmony (``HarmonySplitter``): the ``analysis`` channel is reasoning, ``final`` (and
``commentary`` to no one) content, a message ``to=functions.NAME`` a call whose body is the
arguments' JSON. A reply continues the prompt's ``<|start|>assistant``: ``<|channel|>analysis
<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...``; a message's header may
name its recipient in the role (`` to=functions.f<|channel|>commentary``) or the channel
(``<|channel|>commentary to=functions.f <|constrain|>json``). A message to another recipient
(the built-in ``python``, ``container.exec``) is dropped, as llama-server does.

Muse Glimmer (``GlimmerSplitter``, as llama.cpp's common/parsers/muse-glimmer.cpp): each
message is `` to=RECIPIENT<|message|>BODY`` ended by ``<|eom|>`` (more follow, each after
``<|start|>assistant``) or ``<|eot|>``; ``to=self`` is reasoning, ``to=user`` (or no recipient)
content, any other recipient a call whose body is one ``<atem:function_calls>`` block (``ATEM``)."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Literal

from ...wire.jsontext import read_bounded
from ..structured import SchemaExpr, literal, seq
from .families import Block, Props, _xml_param_rules
from .families import Call as BlockCall
from .markup import HeldText, NextMark, elements, held_back, partial_suffix, typed_value
from .tools import Tool

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")  # what ends a message's body
HEADER_STARTS = ("<|channel|>", "<|start|>", " to=", "to=")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")

MAX_HEADER = 512  # characters of a message header before it is taken as text: real ones are short
Kind = Literal["reasoning", "content", "call", "drop"]
Call = tuple[str, str]  # (name, the arguments as written out)
Accept = Callable[[str, dict[str, Any]], str | None]  # (name, arguments) -> written arguments; None: not a call


class _ChannelSplitter(ABC):
    """Feeds of a reply in a channel dialect -> (reasoning, content, calls) releasable so far.
    ``reasoning``: split the reasoning channel out (else it is content); ``parse_tools``: read
    calls (else their bodies are content); ``accept(name, arguments)``: a call's arguments as
    written out, None when it is not a call (a tool not declared: its body is content). A dialect says what ends a message's body
    (``ends``; ``next_header``: the end that is the next message's header too), what a header
    means (``_header``) and what a body gives (``_emit``)."""

    ends: tuple[str, ...]
    next_header = ""

    def __init__(self, *, reasoning: bool, parse_tools: bool, accept: Accept) -> None:
        self._reasoning = reasoning
        self._parse_tools = parse_tools
        self._accept = accept
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
    def _emit(self, body: str, reasoning: list[str], content: list[str], calls: list[Call], *, done: bool, cut: bool = False) -> None:
        """A body (``done``: the whole of it) into reasoning, content or a call (``cut``: the
        length cap ended it: a call that does not read whole is dropped, never content)."""


class HarmonySplitter(_ChannelSplitter):
    """gpt-oss's harmony: the analysis channel is the reasoning; a message to
    ``functions.NAME`` a call, to another recipient dropped."""

    ends = ENDS
    next_header = "<|start|>"  # opens the next message's header; the others end this one

    def _header(self, head: str, *, complete: bool) -> tuple[Kind, str] | None:
        lead = head.lstrip()  # the same test whole or in part: any split reads as the whole does
        if not complete:  # (what may yet be <|message|> is not the header's)
            lead = lead[: len(lead) - partial_suffix(lead, MESSAGE)]
        if lead and not any(h.startswith(lead[: len(h)]) for h in HEADER_STARTS):
            return None
        if not complete:
            return "content", ""
        channel = m.group(1) if (m := _CHANNEL.search(head)) else ""
        recipient = m.group(1) if (m := _RECIPIENT.search(head)) else ""
        if recipient.startswith("functions."):
            return ("call" if self._parse_tools else "content"), recipient[len("functions."):]
        if recipient:
            return "drop", recipient
        if channel == "analysis" and self._reasoning:
            return "reasoning", ""
        return "content", ""

    def _emit(self, body: str, reasoning: list[str], content: list[str], calls: list[Call], *, done: bool, cut: bool = False) -> None:
        if self._kind == "reasoning":
            reasoning.append(body)
        elif self._kind == "content":
            content.append(body)
        elif self._kind == "call" and done:
            try:
                args = read_bounded(body)
            except ValueError:
                args = None
            written = self._accept(self._name, args) if isinstance(args, dict) else None
            if written is not None:
                calls.append((self._name, written))
            elif not cut:
                content.append(body)


# -- Muse Glimmer

EOM, EOT = "<|eom|>", "<|eot|>"
NEXT = "<|start|>assistant"  # opens each message after the first (the prompt ends with it)
GLIMMER_MARKS = ("<|start|>", MESSAGE, EOM, EOT, "<atem:invoke", "</atem:invoke>", "<atem:parameter", "</atem:parameter>")


def _read_atem(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[BlockCall] | None:
    """The invocations of one ``<atem:function_calls>`` block: a parameter's text as is for a
    string, else its JSON (the text where it is not JSON), as llama.cpp reads them."""
    calls: list[BlockCall] = []
    for name, inner in elements(body, '<atem:invoke name="', '">', "</atem:invoke>") or ():
        params = elements(inner, '<atem:parameter name="', '">', "</atem:parameter>")
        if not name or '"' in name or params is None or any(not k or '"' in k for k, _ in params):
            return None
        props = props_of(name) or {}
        calls.append((name, {k: typed_value(v, props.get(k)) for k, v in params}, None))
    return calls or None


def _atem_rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
    """One call as its own message to the tool, as the template prints an earlier one."""
    params, rules = _xml_param_rules(
        tool, i, schema, lambda k: (f'<atem:parameter name="{k}">', "</atem:parameter>\n"), True
    )
    head = literal(f' to={tool.name}<|message|><atem:function_calls>\n<atem:invoke name="{tool.name}">\n')
    return seq(head, params, literal("</atem:invoke>\n</atem:function_calls>")), rules


ATEM = Block(openers=("<atem:function_calls>",), closer="</atem:function_calls>", read=_read_atem, call_rule=_atem_rule)


def _recipient(head: str, complete: bool) -> str | None:
    """A message header's recipient ("" for none); None when ``head`` is not (the start of,
    unless ``complete``) ``[<|start|>assistant] [to=RECIPIENT]``."""
    h = head.lstrip()
    if not complete and NEXT.startswith(h):
        return ""
    h = h.removeprefix(NEXT).lstrip()
    if not complete:
        h = h[: len(h) - partial_suffix(h, MESSAGE)]
        if "to=".startswith(h):
            return ""
    if not h:
        return ""
    if not h.startswith("to=") or "<" in h or "\n" in h:
        return None
    return h[3:].split(" ", 1)[0]


class GlimmerSplitter(_ChannelSplitter):
    """Muse Glimmer: ``to=self`` the reasoning, ``to=user`` (or none) content, any other
    recipient a call; ``props_of(name)`` a tool's parameters (typing values)."""

    ends = (EOM, EOT)

    def __init__(self, *, reasoning: bool, parse_tools: bool, accept: Accept, props_of: Callable[[str], Props | None]) -> None:
        super().__init__(reasoning=reasoning, parse_tools=parse_tools, accept=accept)
        self._props_of = props_of

    def _header(self, head: str, *, complete: bool) -> tuple[Kind, str] | None:
        recipient = _recipient(head, complete)
        return None if recipient is None else (self._kind_of(recipient), recipient)

    def _kind_of(self, recipient: str) -> Kind:
        if recipient == "self":
            return "reasoning" if self._reasoning else "content"
        return "call" if recipient not in ("", "user") and self._parse_tools else "content"

    def _emit(self, body: str, reasoning: list[str], content: list[str], calls: list[Call], *, done: bool, cut: bool = False) -> None:
        if self._kind == "reasoning":
            reasoning.append(body)
        elif self._kind == "content":
            content.append(body)
        elif done:
            text = body.strip()
            found = None
            if text.startswith(ATEM.openers[0]) and text.endswith(ATEM.closer):
                found = _read_atem(text[len(ATEM.openers[0]):-len(ATEM.closer)], ATEM.openers[0], self._props_of)
            written = [self._accept(n, a) for n, a, _ in found or ()]
            if found and None not in written:
                calls.extend((n, w) for (n, _, _), w in zip(found, written, strict=True) if w is not None)
            elif not cut:
                content.append(body)
