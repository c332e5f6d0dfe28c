"""Muse Glimmer (as llama.cpp's common/parsers/muse-glimmer.cpp): each message is
`` to=RECIPIENT<|message|>BODY`` ended by ``<|eom|>`` (more follow, each after
``<|start|>assistant``) or ``<|eot|>``; ``to=self`` is reasoning, ``to=user`` (or no recipient)
content, any other recipient a call whose body is one ``<atem:function_calls>`` block
(``ATEM``). Under auto the grammar starts where a message to a declared tool does
(``tool_trigger``), as llama.cpp's pattern skips ``self`` and ``user``. Pure."""

from __future__ import annotations

from collections.abc import Callable

from ...structured import SchemaExpr, literal, seq
from ..markup import elements, partial_suffix, typed_value
from ..tools import Tool
from .channels import MESSAGE, Call, ChannelSplitter, Kind
from .param_rules import xml_param_rules
from .roster import register
from .toolformat import Block, Detect, Props, ToolFormat
from .toolformat import Call as BlockCall

EOM, EOT = "<|eom|>", "<|eot|>"
NEXT = "<|start|>assistant"  # opens each message after the first (the prompt ends with it)
GLIMMER_MARKS = (
    "<|start|>",
    MESSAGE,
    EOM,
    EOT,
    "<atem:invoke",
    "</atem:invoke>",
    "<atem:parameter",
    "</atem:parameter>",
)


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
    params, rules = xml_param_rules(
        tool, i, schema, lambda k: (f'<atem:parameter name="{k}">', "</atem:parameter>\n"), True
    )
    head = literal(f' to={tool.name}<|message|><atem:function_calls>\n<atem:invoke name="{tool.name}">\n')
    return seq(head, params, literal("</atem:invoke>\n</atem:function_calls>")), rules


ATEM = Block(openers=("<atem:function_calls>",), closer="</atem:function_calls>", read=_read_atem)


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


class GlimmerSplitter(ChannelSplitter):
    """Muse Glimmer: ``to=self`` the reasoning, ``to=user`` (or none) content, any other
    recipient a call; ``props_of(name)`` a tool's parameters (typing values)."""

    ends = (EOM, EOT)

    def _header(self, head: str, *, complete: bool) -> tuple[Kind, str] | None:
        recipient = _recipient(head, complete)
        return None if recipient is None else (self._kind_of(recipient), recipient)

    def _kind_of(self, recipient: str) -> Kind:
        if recipient == "self":
            return "reasoning" if self._reasoning else "content"
        return "call" if recipient not in ("", "user") and self._parse_tools else "content"

    def _emit(
        self, body: str, reasoning: list[str], content: list[str], calls: list[Call], *, done: bool, cut: bool = False
    ) -> None:
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


GLIMMER = register(ToolFormat(
    "muse_glimmer",
    "arguments",
    between="<|eom|><|start|>assistant",
    block=ATEM,
    call_rule=_atem_rule,
    splitter=GlimmerSplitter,
    marks=GLIMMER_MARKS,
    tool_trigger=(" to={name}<|message|>", "<atem:function_calls>"),
    detect=(Detect(20, ("<atem:function_calls>", "<|eom|>")),),  # as llama.cpp tells it
))
