"""A model's reply read back: the one incremental parser that turns streamed text into
content, reasoning and whole tool calls, in the template's ``ToolFormat``: the think split
(reasoning.py), then the call scanner (scanner.py), or a channel dialect's own reader. Pure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .families import GENERIC, ChannelReader, Props, ToolFormat
from .formats import written_arguments
from .reasoning import CLOSE, OPEN, ThinkSplitter
from .scanner import CallScanner, ToolCall, new_call_id
from .tools import ToolRequest


@dataclass
class ReplyDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class ReplyParser:
    """One reply's text, fed piece by piece as it streams, split into content, reasoning and
    tool calls. Only text that may still be part of a marker, an open call or a think tag is
    held back; ``finish`` releases it (an unfinished call is content, as llama-server does).
    The deltas of any split of a reply join to exactly what ``parse_reply`` gives for it.

    ``tools``: the declared tools (a call naming another is content); None: any name."""

    def __init__(
        self,
        fmt: ToolFormat | None,
        *,
        parse_tools: bool,
        reasoning: bool,
        starts_in_reasoning: bool = False,
        tools: ToolRequest | None = None,
        new_id: Callable[[], str] = new_call_id,
        think_tags: tuple[str, str] = (OPEN, CLOSE),
        reasoning_lead: str = "",
    ) -> None:
        names = None if tools is None else frozenset(t.name for t in tools.callable)
        props = {} if tools is None else {t.name: _properties(t.parameters) for t in tools.callable}
        self._new_id = new_id
        self._channels: ChannelReader | None = None
        self._think: ThinkSplitter | None = None
        self._scanner: CallScanner | None = None
        self._channel_calls: list[ToolCall] = []

        def accept(name: str, args: dict[str, Any]) -> str | None:
            return written_arguments(args) if names is None or name in names else None

        if fmt is not None and fmt.splitter is not None:  # its channels carry reasoning, content and calls alike
            self._channels = fmt.splitter(
                reasoning=reasoning, parse_tools=parse_tools, accept=accept, props_of=props.get
            )
        else:
            self._think = (
                ThinkSplitter(starts_in_reasoning=starts_in_reasoning, tags=think_tags, lead=reasoning_lead)
                if reasoning
                else None
            )
            if parse_tools:
                self._scanner = CallScanner(fmt or GENERIC, names, new_id, props)
            elif fmt is not None and (fmt.dropped or fmt.recipient):
                # Markup around content is removed without tools too (no call is then accepted).
                self._scanner = CallScanner(fmt, frozenset(), new_id)
            else:
                self._scanner = None
        self._content: list[str] = []
        self._reasoning: list[str] = []

    def feed(self, text: str) -> ReplyDelta:
        return self._step(text, final=False)

    def finish(self, *, cut: bool = False) -> ReplyDelta:
        """The rest of the reply. ``cut``: the length cap ended it, so a call it left open is
        never content: its whole calls are kept (a list cut after its first calls), the rest
        dropped, as is a marker's beginning."""
        return self._step("", final=True, cut=cut)

    def _step(self, text: str, *, final: bool, cut: bool = False) -> ReplyDelta:
        if self._channels is not None:
            reasoning, text, found = self._channels.feed(text, final=final, cut=cut)
            base = len(self._channel_calls)
            calls = [ToolCall(base + i, self._new_id(), n, a) for i, (n, a) in enumerate(found)]
            self._channel_calls.extend(calls)
            self._content.append(text)
            self._reasoning.append(reasoning)
            return ReplyDelta(content=text, reasoning=reasoning, tool_calls=calls)
        reasoning = ""
        if self._think is not None:
            reasoning, text = self._think.feed(text)
            if final:
                more_reasoning, more = self._think.finish()
                reasoning, text = reasoning + more_reasoning, text + more
        calls: list[ToolCall] = []
        if self._scanner is not None:
            text, calls = self._scanner.feed(text, final=final, cut=cut)
        self._content.append(text)
        self._reasoning.append(reasoning)
        return ReplyDelta(content=text, reasoning=reasoning, tool_calls=calls)

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def calls(self) -> list[ToolCall]:
        if self._channels is not None:
            return list(self._channel_calls)
        return list(self._scanner.calls) if self._scanner is not None else []


def _properties(schema: Any) -> Props:
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def parse_reply(
    text: str,
    fmt: ToolFormat | None,
    *,
    parse_tools: bool,
    reasoning: bool,
    starts_in_reasoning: bool = False,
    tools: ToolRequest | None = None,
    new_id: Callable[[], str] = new_call_id,
    think_tags: tuple[str, str] = (OPEN, CLOSE),
    reasoning_lead: str = "",
) -> ReplyDelta:
    """A whole (non-streamed) reply: one feed and the finish."""
    parser = ReplyParser(
        fmt,
        parse_tools=parse_tools,
        reasoning=reasoning,
        starts_in_reasoning=starts_in_reasoning,
        tools=tools,
        new_id=new_id,
        think_tags=think_tags,
        reasoning_lead=reasoning_lead,
    )
    first, last = parser.feed(text), parser.finish()
    return ReplyDelta(
        first.content + last.content, first.reasoning + last.reasoning, first.tool_calls + last.tool_calls
    )
