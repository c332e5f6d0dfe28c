"""gpt-oss's harmony reply read back: its messages' channels split into reasoning
(``analysis``), content (``final``, and ``commentary`` to no one) and tool calls (a message
``to=functions.NAME``, its body the arguments' JSON), incrementally (any split of a reply
gives what the whole reply gives). Pure.

A reply continues the prompt's ``<|start|>assistant``: ``<|channel|>analysis<|message|>...
<|end|><|start|>assistant<|channel|>final<|message|>...``; a message's header may name its
recipient in the role (`` to=functions.f<|channel|>commentary``) or the channel
(``<|channel|>commentary to=functions.f <|constrain|>json``). A message to another recipient
(the built-in ``python``, ``container.exec``) is dropped, as llama-server does."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal

from .reasoning import partial_suffix

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")  # what ends a message's body
HEADER_STARTS = ("<|channel|>", "<|start|>", " to=", "to=")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")

Kind = Literal["reasoning", "content", "call", "drop"]
Call = tuple[str, dict[str, Any]]


class HarmonySplitter:
    """Feeds of a reply -> (reasoning, content, calls) releasable so far. ``reasoning``:
    split the analysis channel out (else it is content); ``parse_tools``: read calls (else
    their bodies are content); ``accept(name)``: whether a call's name is a declared tool
    (a call of another is content)."""

    def __init__(self, *, reasoning: bool, parse_tools: bool, accept: Callable[[str], bool]) -> None:
        self._reasoning = reasoning
        self._parse_tools = parse_tools
        self._accept = accept
        self._state: Literal["header", "body", "plain"] = "header"
        self._buf = ""
        self._kind: Kind = "content"
        self._name = ""

    def feed(self, text: str, *, final: bool = False) -> tuple[str, str, list[Call]]:
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
                if k < 0:
                    lead = buf.lstrip()
                    if lead and not any(h.startswith(lead[: len(h)]) for h in HEADER_STARTS):
                        self._state = "plain"  # not harmony markup: the reply is its text
                        continue
                    if final:
                        content.append(buf)  # a header with no message: shown as written
                        self._buf = ""
                    break
                self._kind, self._name = self._header(buf[:k])
                self._state, self._buf = "body", buf[k + len(MESSAGE):]
            else:
                ends = [(j, m) for m in ENDS if (j := buf.find(m)) >= 0]
                if ends:
                    j, mark = min(ends)
                    self._emit(buf[:j], reasoning, content, calls, done=True)
                    # <|start|> opens the next message's header; the others end this one
                    self._state, self._buf = "header", buf[j if mark == "<|start|>" else j + len(mark):]
                elif final:
                    self._emit(buf, reasoning, content, calls, done=True)
                    self._buf = ""
                elif self._kind in ("call", "drop"):
                    break  # held whole until it ends
                else:
                    keep = partial_suffix(buf, *ENDS)
                    self._emit(buf[: len(buf) - keep], reasoning, content, calls, done=False)
                    self._buf = buf[len(buf) - keep:]
                    break
        return "".join(reasoning), "".join(content), calls

    def _header(self, header: str) -> tuple[Kind, str]:
        channel = m.group(1) if (m := _CHANNEL.search(header)) else ""
        recipient = m.group(1) if (m := _RECIPIENT.search(header)) else ""
        if recipient.startswith("functions."):
            return ("call" if self._parse_tools else "content"), recipient[len("functions."):]
        if recipient:
            return "drop", recipient
        if channel == "analysis" and self._reasoning:
            return "reasoning", ""
        return "content", ""

    def _emit(self, body: str, reasoning: list[str], content: list[str], calls: list[Call], *, done: bool) -> None:
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
            else:
                content.append(body)
