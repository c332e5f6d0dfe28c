"""A model's reply read back: the one incremental parser that turns streamed text into
content, reasoning and whole tool calls, in the template's ``ToolFormat``. Pure."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...wire.errors import ProtocolError
from ...wire.jsontext import parse_json
from .families import MAX_SALVAGE_TRIES, Props
from .formats import GENERIC, ToolFormat, dump_arguments
from .harmony import GlimmerSplitter, HarmonySplitter
from .reasoning import CLOSE, OPEN, ThinkSplitter, partial_suffix
from .tools import ToolRequest


@dataclass(frozen=True)
class ToolCall:
    index: int  # the call's place among the reply's calls, from 0
    id: str
    name: str
    arguments: str  # the arguments object as compact JSON text (dump_arguments)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ReplyDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class _JsonEnd:
    """Where a JSON object or array that starts at ``start`` ends, found incrementally (the
    text only grows while a call streams in, so each character is scanned once)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._end: int | None = None

    def end(self, text: str) -> int | None:
        if self._end is not None:
            return self._end
        for k in range(self._pos, len(text)):
            c = text[k]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end = k + 1
                    return self._end
        self._pos = len(text)
        return None


MAX_RECIPIENT = 128  # characters of a recipient's line (functionary) before it is taken as text


class _CallScanner:
    """Content text -> (content, calls) for one format."""

    def __init__(
        self, fmt: ToolFormat, names: frozenset[str] | None, new_id: Callable[[], str], props: dict[str, Props] | None = None
    ) -> None:
        self._fmt = fmt
        self._names = names
        self._props = props or {}  # tool name -> its parameters' properties (typing XML values)
        self._new_id = new_id
        self._buf = ""  # text not decided yet: a possible marker's start, or an open call
        self._ws = ""  # whitespace held: dropped when a call comes next to it
        self._after_call = False  # the last thing decided was a call
        self._seen_text = False  # content other than whitespace was released
        self._json: _JsonEnd | None = None  # the open region's JSON scan
        self._fresh = True  # a recipient format's reply start is not decided yet
        self._name = ""  # the open recipient region's tool name
        self.calls: list[ToolCall] = []

    def feed(self, text: str, *, final: bool = False, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """``final``: the reply ended; ``cut``: by the length cap, so text that may still be a
        call (an open region, a marker's beginning) is never released as content, and an open
        region's whole calls are read (``_salvage``)."""
        self._buf += text
        out: list[str] = []
        new: list[ToolCall] = []
        done = final and not cut  # whether what is held can no longer become a call
        while self._buf:
            start, marker = self._find_start(done)
            self._text(self._buf[:start], out)
            self._buf = self._buf[start:]
            if marker is None:
                if final:
                    if not cut:
                        self._text(self._buf, out)
                    self._buf = ""
                break
            if marker and self._buf[:marker] in self._fmt.dropped:
                outcome = marker, None
            elif self._fmt.block is not None:
                outcome = self._block(marker, done)
            elif self._fmt.recipient:
                outcome = self._recipient(marker, done)
            else:
                outcome = self._region(marker)
            if outcome is None:  # the region is still open
                if final:
                    if not cut:
                        self._text(self._buf, out)
                    elif calls := self._salvage(marker):
                        self._ws, self._after_call = "", True
                        new.extend(calls)
                        self.calls.extend(calls)
                    self._buf, self._json, self._fresh = "", None, False
                break
            end, calls = outcome
            self._json = None
            if calls:
                self._ws, self._after_call = "", True
                new.extend(calls)
                self.calls.extend(calls)
            elif calls is not None:  # None: a marker that is dropped (a recipient's content line)
                self._text(self._buf[:end], out)
            self._buf = self._buf[end:]
        if final and not self._after_call:
            out.append(self._ws)
            self._ws = ""
        return "".join(out), new

    def _find_start(self, final: bool) -> tuple[int, int | None]:
        """(i, marker length) when a region starts at ``self._buf[i]``; (i, None) when no
        region starts in the text and ``self._buf[:i]`` is plain text (the rest is held)."""
        fmt, buf = self._fmt, self._buf
        if self._json is not None:
            return 0, 0  # an open region: always at the buffer's start, its marker passed
        if fmt.recipient and self._fresh:  # the reply's first recipient line has no marker
            if buf.startswith(fmt.opener):
                self._fresh = False
            elif not final and fmt.opener.startswith(buf):
                return 0, None
            else:
                return 0, 0
        if fmt.block is not None:
            marks = (*fmt.block.openers, *fmt.dropped)
            found = [(k, len(o)) for o in marks if (k := buf.find(o)) >= 0]
            if found:
                return min(found)
            if not final:
                return len(buf) - partial_suffix(buf, *marks), None
            return len(buf), None
        j = len(buf) - len(buf.lstrip())
        if j < len(buf):
            c = buf[j]
            if fmt.at_start and c == "{" and not self._seen_text and not self.calls:
                return j, 0
            if fmt.separator and self._after_call and buf.startswith(fmt.separator, j):
                return j, len(fmt.separator)
        if fmt.opener:
            k = buf.find(fmt.opener)
            if k >= 0:
                return k, len(fmt.opener)
            if not final:
                return len(buf) - partial_suffix(buf, fmt.opener), None
        return len(buf), None

    def _region(self, marker: int) -> tuple[int, list[ToolCall]] | None:
        """A region at the buffer's start whose marker is ``marker`` characters: None while
        it is open; else (its end, its calls), no calls when it is not a valid call (its
        text up to the end is then content)."""
        fmt, buf = self._fmt, self._buf
        if self._json is None:
            j = marker
            while j < len(buf) and buf[j].isspace():
                j += 1
            if j == len(buf):
                return None
            if buf[j] != ("[" if fmt.listed else "{"):
                return max(marker, 1), []  # the marker alone: content
            self._json = _JsonEnd(j)
        end = self._json.end(buf)
        if end is None:
            return None
        value_text = buf[self._json.start:end]
        if fmt.closer:
            k = end
            while k < len(buf) and buf[k].isspace():
                k += 1
            rest = buf[k:k + len(fmt.closer)]
            if len(rest) < len(fmt.closer) and fmt.closer.startswith(rest):
                return None
            if rest != fmt.closer:
                return end, []
            end = k + len(fmt.closer)
        return end, self._calls_of(value_text)

    def _recipient(self, marker: int, final: bool) -> tuple[int, list[ToolCall] | None] | None:
        """A recipient format's message at the buffer's start (``marker`` 0: the reply's
        first, its marker in the prompt): None while it is open; (its line's end, None) for
        content's recipient (the line dropped); else (its end, its call), no call when it is
        not one (the marker is then content)."""
        fmt, buf = self._fmt, self._buf
        if self._json is None:
            nl = buf.find("\n", marker)
            if nl < 0:
                if not final and len(buf) - marker <= MAX_RECIPIENT:
                    return None
                self._fresh = False
                return marker, []
            name = buf[marker:nl].strip()
            self._fresh = False
            if name == fmt.recipient:
                return nl + 1, None
            if not name or any(c.isspace() for c in name) or (self._names is not None and name not in self._names):
                return marker, []
            j = nl + 1
            while j < len(buf) and buf[j].isspace():
                j += 1
            if j == len(buf):
                self._fresh = marker == 0
                return None
            if buf[j] != "{":
                return marker, []
            self._json, self._name = _JsonEnd(j), name
        end = self._json.end(buf)
        if end is None:
            return None
        try:
            args = parse_json(buf[self._json.start:end].encode("utf-8", "surrogatepass"), "tool call")
        except (ProtocolError, UnicodeError):
            args = None
        if not isinstance(args, dict):
            return max(marker, len(fmt.opener) if buf.startswith(fmt.opener) else 0), []
        return end, [ToolCall(len(self.calls), self._new_id(), self._name, dump_arguments(args))]

    def _block(self, marker: int, final: bool) -> tuple[int, list[ToolCall]] | None:
        """A family's block region (families.py) at the buffer's start: None while its closer
        (or the optional tail after it) may still come; else (its end, its calls)."""
        block, buf = self._fmt.block, self._buf
        assert block is not None
        closer = block.closers[block.openers.index(buf[:marker])] if block.closers else block.closer
        k = buf.find(closer, marker)
        if k < 0:
            return None
        end = k + len(closer)
        if block.tail:
            j = end
            while j < len(buf) and buf[j].isspace():
                j += 1
            rest = buf[j:j + len(block.tail)]
            if rest == block.tail:
                end = j + len(block.tail)
            elif not final and len(rest) < len(block.tail) and block.tail.startswith(rest):
                return None
        found = block.read(buf[marker:k], buf[:marker], self._props.get)
        if not found or (self._names is not None and any(n not in self._names for n, _, _ in found)):
            return max(marker, 1), []  # not calls: the opener is content, the scan goes on after it
        base = len(self.calls)
        return end, [
            ToolCall(base + i, given or self._new_id(), name, dump_arguments(args)) for i, (name, args, given) in enumerate(found)
        ]

    def _salvage(self, marker: int) -> list[ToolCall]:
        """The whole calls of the open region the length cap cut (a list or a block of
        several calls, read up to its last whole call); none for a region of one call."""
        fmt, buf = self._fmt, self._buf
        if fmt.block is not None or fmt.recipient:
            whole = self._block(marker, True) if fmt.block is not None else self._recipient(marker, True)
            if whole is not None and whole[1]:  # its call ended (a tail after it was cut)
                return whole[1]
        if fmt.block is not None:
            found = fmt.block.salvage(buf[marker:], buf[:marker], self._props.get)
            if not found or (self._names is not None and any(n not in self._names for n, _, _ in found)):
                return []
            base = len(self.calls)
            return [ToolCall(base + i, given or self._new_id(), n, dump_arguments(a)) for i, (n, a, given) in enumerate(found)]
        if self._json is None or not (fmt.listed or fmt.list_key):
            return []
        text, close = buf[self._json.start:], "]" if fmt.listed else "]}"
        end = len(text)
        for _ in range(MAX_SALVAGE_TRIES):
            k = text.rfind("}", 0, end)
            if k < 0:
                return []
            if calls := self._calls_of(text[: k + 1] + close):
                return calls
            end = k
        return []

    def _calls_of(self, text: str) -> list[ToolCall]:
        """The calls a region's JSON holds; none unless every one is a valid call."""
        try:
            value = parse_json(text.encode("utf-8", "surrogatepass"), "tool call")
        except (ProtocolError, UnicodeError):
            return []
        fmt = self._fmt
        if fmt.list_key:
            value = value.get(fmt.list_key) if isinstance(value, dict) and len(value) == 1 else None
        items = value if fmt.listed or fmt.list_key else [value]
        if not isinstance(items, list) or not items:
            return []
        found: list[tuple[str, dict[str, Any]]] = []
        for item in items:
            if not isinstance(item, dict):
                return []
            name = item.get("name")
            args = item.get(fmt.args_key, item.get("arguments" if fmt.args_key != "arguments" else "parameters"))
            if not isinstance(name, str) or not isinstance(args, dict):
                return []
            if self._names is not None and name not in self._names:
                return []
            found.append((name, args))
        base = len(self.calls)
        return [ToolCall(base + i, self._new_id(), name, dump_arguments(args)) for i, (name, args) in enumerate(found)]

    def _text(self, text: str, out: list[str]) -> None:
        """Release ``text`` as content, holding its trailing whitespace: whitespace next to a
        call is dropped, any other is released with the text after it (or at the end)."""
        if not text:
            return
        core = text.strip()
        if not core:
            self._ws += text
            return
        lead = len(text) - len(text.lstrip())
        if not self._after_call:
            out.append(self._ws + text[:lead])
        out.append(core)
        self._ws = text[lead + len(core):]
        self._after_call = False
        self._seen_text = True


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
        self._harmony: HarmonySplitter | GlimmerSplitter | None = None
        self._think: ThinkSplitter | None = None
        self._scanner: _CallScanner | None = None
        self._harmony_calls: list[ToolCall] = []
        if fmt is not None and fmt.channels == "glimmer":
            self._harmony = GlimmerSplitter(
                reasoning=reasoning, parse_tools=parse_tools, accept=lambda n: names is None or n in names, props_of=props.get
            )
        elif fmt is not None and fmt.harmony:  # its channels carry reasoning, content and calls alike
            self._harmony = HarmonySplitter(
                reasoning=reasoning, parse_tools=parse_tools, accept=lambda n: names is None or n in names
            )
        else:
            self._think = (
                ThinkSplitter(starts_in_reasoning=starts_in_reasoning, tags=think_tags, lead=reasoning_lead) if reasoning else None
            )
            if parse_tools:
                self._scanner = _CallScanner(fmt or GENERIC, names, new_id, props)
            elif fmt is not None and (fmt.dropped or fmt.recipient):
                # Markup around content is removed without tools too (no call is then accepted).
                self._scanner = _CallScanner(fmt, frozenset(), new_id)
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
        if self._harmony is not None:
            reasoning, text, found = self._harmony.feed(text, final=final, cut=cut)
            base = len(self._harmony_calls)
            calls = [ToolCall(base + i, self._new_id(), n, dump_arguments(a)) for i, (n, a) in enumerate(found)]
            self._harmony_calls.extend(calls)
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
        if self._harmony is not None:
            return list(self._harmony_calls)
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
    return ReplyDelta(first.content + last.content, first.reasoning + last.reasoning, first.tool_calls + last.tool_calls)
