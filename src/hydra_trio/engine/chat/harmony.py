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

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Literal

from ..structured import SchemaExpr, literal, seq
from .families import Block, Props, _xml_param_rules, typed_value
from .families import Call as BlockCall
from .reasoning import partial_suffix
from .tools import Tool

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")  # what ends a message's body
HEADER_STARTS = ("<|channel|>", "<|start|>", " to=", "to=")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")

Kind = Literal["reasoning", "content", "call", "drop"]
Call = tuple[str, dict[str, Any]]


class _ChannelSplitter(ABC):
    """Feeds of a reply in a channel dialect -> (reasoning, content, calls) releasable so far.
    ``reasoning``: split the reasoning channel out (else it is content); ``parse_tools``: read
    calls (else their bodies are content); ``accept(name)``: whether a call's name is a
    declared tool (a call of another is content). A dialect says what ends a message's body
    (``ends``; ``next_header``: the end that is the next message's header too), what a header
    means (``_header``) and what a body gives (``_emit``)."""

    ends: tuple[str, ...]
    next_header = ""

    def __init__(self, *, reasoning: bool, parse_tools: bool, accept: Callable[[str], bool]) -> None:
        self._reasoning = reasoning
        self._parse_tools = parse_tools
        self._accept = accept
        self._state: Literal["header", "body", "plain"] = "header"
        self._buf = ""
        self._kind: Kind = "content"
        self._name = ""

    def feed(self, text: str, *, final: bool = False, cut: bool = False) -> tuple[str, str, list[Call]]:
        """``cut``: the length cap ended the reply: a call message it left open (or a header
        not yet through to its message) is dropped, never content."""
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[Call] = []
        while self._buf:
            buf = self._buf
            if self._state == "plain":
                content.append(buf)
                self._buf = ""
            elif self._state == "header":
                k = buf.find(MESSAGE)
                head = self._header(buf if k < 0 else buf[:k], complete=k >= 0)
                if head is None:
                    self._state = "plain"  # not a message header: the reply is its text
                    continue
                if k < 0:
                    if final:
                        if not cut:
                            content.append(buf)  # a header with no message: shown as written
                        self._buf = ""
                    break
                self._kind, self._name = head
                self._state, self._buf = "body", buf[k + len(MESSAGE):]
            else:
                ends = [(j, m) for m in self.ends if (j := buf.find(m)) >= 0]
                if ends:
                    j, mark = min(ends)
                    self._emit(buf[:j], reasoning, content, calls, done=True)
                    self._state, self._buf = "header", buf[j if mark == self.next_header else j + len(mark):]
                elif final:
                    if cut:  # a body the cap cut in its end marker: the body without the marker's beginning
                        buf = buf[: len(buf) - partial_suffix(buf, *self.ends)]
                    self._emit(buf, reasoning, content, calls, done=True, cut=cut)
                    self._buf = ""
                elif self._kind in ("call", "drop"):
                    break  # held whole until it ends
                else:
                    keep = partial_suffix(buf, *self.ends)
                    self._emit(buf[: len(buf) - keep], reasoning, content, calls, done=False)
                    self._buf = buf[len(buf) - keep:]
                    break
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
        if not complete:
            lead = head.lstrip()
            if lead and not any(h.startswith(lead[: len(h)]) for h in HEADER_STARTS):
                return None
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
                args = json.loads(body)
            except ValueError:
                args = None
            if isinstance(args, dict) and self._accept(self._name):
                calls.append((self._name, args))
            elif not cut:
                content.append(body)


# -- Muse Glimmer

EOM, EOT = "<|eom|>", "<|eot|>"
NEXT = "<|start|>assistant"  # opens each message after the first (the prompt ends with it)
GLIMMER_MARKS = ("<|start|>", MESSAGE, EOM, EOT, "<atem:invoke", "</atem:invoke>", "<atem:parameter", "</atem:parameter>")
_INVOKE = re.compile(r'\s*<atem:invoke name="([^"]+)">(.*?)</atem:invoke>', re.S)
_PARAM = re.compile(r'\s*<atem:parameter name="([^"]+)">(.*?)</atem:parameter>', re.S)


def _read_atem(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[BlockCall] | None:
    """The invocations of one ``<atem:function_calls>`` block: a parameter's text as is for a
    string, else its JSON (the text where it is not JSON), as llama.cpp reads them."""
    calls: list[BlockCall] = []
    pos = 0
    for m in _INVOKE.finditer(body):
        if m.start() != pos:
            return None
        name, inner, props = m.group(1), m.group(2), props_of(m.group(1)) or {}
        args: dict[str, Any] = {}
        at = 0
        for pm in _PARAM.finditer(inner):
            if pm.start() != at:
                return None
            args[pm.group(1)] = typed_value(pm.group(2), props.get(pm.group(1)))
            at = pm.end()
        if inner[at:].strip():
            return None
        calls.append((name, args, None))
        pos = m.end()
    return calls if calls and not body[pos:].strip() else None


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

    def __init__(
        self, *, reasoning: bool, parse_tools: bool, accept: Callable[[str], bool], props_of: Callable[[str], Props | None]
    ) -> None:
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
            if found and all(self._accept(n) for n, _, _ in found):
                calls.extend((n, a) for n, a, _ in found)
            elif not cut:
                content.append(body)
