"""gpt-oss's harmony (``HarmonySplitter``): the ``analysis`` channel is reasoning, ``final``
(and ``commentary`` to no one) content, a message ``to=functions.NAME`` a call whose body is
the arguments' JSON. A reply continues the prompt's ``<|start|>assistant``: ``<|channel|>analysis
<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...``; a message's header may
name its recipient in the role (`` to=functions.f<|channel|>commentary``) or the channel
(``<|channel|>commentary to=functions.f <|constrain|>json``). A message to another recipient
(the built-in ``python``, ``container.exec``) is dropped, as llama-server does. One call a
reply: the model stops at ``<|call|>``. Pure."""

from __future__ import annotations

import re

from ....wire.jsontext import read_bounded
from ...structured import SchemaExpr, literal, seq
from ..markup import partial_suffix
from ..tools import Tool
from .channels import MESSAGE, Call, ChannelSplitter, Kind
from .roster import register
from .toolformat import Detect, ToolFormat, Trigger

ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")  # what ends a message's body
HEADER_STARTS = ("<|channel|>", "<|start|>", " to=", "to=")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
HARMONY_MARKS = ("<|start|>", "<|channel|>", MESSAGE, "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")


class HarmonySplitter(ChannelSplitter):
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

    def _emit(
        self, body: str, reasoning: list[str], content: list[str], calls: list[Call], *, done: bool, cut: bool = False
    ) -> None:
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


def _call(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
    """A commentary message to the function, its body the arguments' JSON."""
    head = literal(f"<|channel|>commentary to=functions.{tool.name} <|constrain|>json<|message|>")
    return seq(head, schema(tool.parameters, f"tools[{i}].function.parameters")), []


HARMONY = register(ToolFormat(
    "harmony",
    "arguments",
    splitter=HarmonySplitter,
    call_rule=_call,
    one_call=True,
    marks=HARMONY_MARKS,
    triggers=(Trigger("<|channel|>commentary to=functions.", False, ""),),
    detect=(Detect(10, ("<|channel|>", "<|message|>")),),
))
