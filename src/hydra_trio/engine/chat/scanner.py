"""Tool calls read out of a reply's content as it streams, in its ``ToolFormat``'s markers:
JSON regions (an opener, a JSON value, a closer), a family's blocks of markup (its ``Block``'s
reader), headed calls (a head, then the arguments' JSON: Functionary's recipient lines,
Mistral's ``NAME[ARGS]``). Linear in the text however it is split: every search starts where
the last one stopped, and an open region sleeps until what it waits for comes.
``parser.ReplyParser`` runs it after the think split. Pure."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from ...wire.jsontext import JsonSpan, read_bounded
from .families import MAX_SALVAGE_TRIES, Props, ToolFormat
from .formats import written_arguments
from .markup import NON_SPACE, NextMark, held_back


@dataclass(frozen=True)
class ToolCall:
    index: int  # the call's place among the reply's calls, from 0
    id: str
    name: str
    arguments: str  # the arguments object as compact JSON text (dump_arguments)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


MAX_HEAD = 128  # characters of a call's head (functionary's recipient line, Mistral's name and id) before it is text


@dataclass
class _Open:
    """An open region's progress between feeds (offsets from its marker's start)."""

    marker: int
    closer_from: int = 0  # a block's closer is looked for from here on
    json_at: int = -1  # a JSON region's value starts here (-1: not yet seen)
    span: JsonSpan | None = None
    name: str = ""  # a recipient region's tool
    head_end: int = -1  # a headed region's head ends here (its end mark passed)
    given: str = ""  # the id the model wrote in the head (Mistral's [CALL_ID])


class _Wake:
    """What an open region waits for: text that cannot change its decision is kept aside
    unread (``woken_by`` looks at the new text only), so a region that stays open over many
    pieces costs each piece its own length, not the region's."""

    def __init__(self, kind: str, literal: str = "", held: str = "", span: JsonSpan | None = None) -> None:
        self._kind = kind  # "text": any text; "nonspace"; "literal" appearing; "json": the value ending
        self._literal = literal
        self._held = held  # the text before, where the literal may have begun
        self._span = span

    def woken_by(self, text: str) -> bool:
        if not text:
            return False
        if self._kind == "nonspace":
            return NON_SPACE.search(text) is not None
        if self._kind == "literal":
            seen = self._held + text
            self._held = seen[len(seen) - len(self._literal) + 1:] if len(self._literal) > 1 else ""
            return self._literal in seen
        if self._kind == "json":
            assert self._span is not None
            return self._span.feed(text) is not None
        return True


Outcome = tuple[int, list[ToolCall] | None] | _Wake


class CallScanner:
    """Content text -> (content, calls) for one format. Linear in the text however it is
    split: every search starts where the last one stopped, and an open region sleeps until
    what it waits for comes (``_Wake``)."""

    def __init__(
        self,
        fmt: ToolFormat,
        names: frozenset[str] | None,
        new_id: Callable[[], str],
        props: dict[str, Props] | None = None,
    ) -> None:
        self._fmt = fmt
        self._names = names
        self._props = props or {}  # tool name -> its parameters' properties (typing XML values)
        self._new_id = new_id
        self._buf = ""  # text not decided yet: a possible marker's start, or an open region
        self._more: list[str] = []  # text after it, kept aside while the open region sleeps
        self._wake: _Wake | None = None
        self._open: _Open | None = None
        self._skip = 0  # openers before this place in _buf are text (a failed block's, bar its last)
        self._ws: list[str] = []  # whitespace held: dropped when a call comes next to it
        self._after_call = False  # the last thing decided was a call
        self._seen_text = False  # content other than whitespace was released
        self._fresh = True  # a recipient format's reply start is not decided yet
        block = fmt.block
        self._marks = (*block.openers, *fmt.dropped) if block is not None else ()
        self._openers = NextMark(block.openers if block is not None else (fmt.opener,) if fmt.opener else ())
        self._dropped = NextMark(fmt.dropped if block is not None else ())
        self.calls: list[ToolCall] = []

    def feed(self, text: str, *, final: bool = False, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """``final``: the reply ended; ``cut``: by the length cap, so text that may still be a
        call (an open region, a marker's beginning) is never released as content, and an open
        region's whole calls are read (``_salvage``)."""
        if self._wake is not None and not final and not self._wake.woken_by(text):
            self._more.append(text)
            return "", []
        buf = "".join((self._buf, *self._more, text))
        self._more.clear()
        self._wake = None
        out: list[str] = []
        new: list[ToolCall] = []
        done = final and not cut  # whether what is held can no longer become a call
        p = 0
        while p < len(buf):
            start, marker = self._find_start(buf, p, done)
            self._text(buf[p:start], out)
            p = start
            if marker is None:
                if final:
                    if not cut:
                        self._text(buf[p:], out)
                    p = len(buf)
                break
            outcome: Outcome
            if marker and buf[p:p + marker] in self._fmt.dropped:
                outcome = p + marker, None
            elif self._fmt.block is not None:
                outcome = self._block(buf, p, marker, done)
            elif self._fmt.headed:
                outcome = self._headed(buf, p, marker, done)
            else:
                outcome = self._region(buf, p, marker)
            if isinstance(outcome, _Wake):  # the region is still open
                if final:
                    if not cut:
                        self._text(buf[p:], out)
                    elif calls := self._salvage(buf, p, marker):
                        self._ws.clear()
                        self._after_call = True
                        new.extend(calls)
                        self.calls.extend(calls)
                    p, self._open, self._fresh = len(buf), None, False
                else:
                    self._wake = outcome
                break
            end, calls = outcome
            self._open = None
            if calls:
                self._ws.clear()
                self._after_call = True
                new.extend(calls)
                self.calls.extend(calls)
            elif calls is not None:  # None: a marker that is dropped (a recipient's content line)
                self._text(buf[p:end], out)
            p = end
        self._buf = buf[p:]
        self._skip = max(0, self._skip - p)
        if final and not self._after_call:
            out.extend(self._ws)
            self._ws.clear()
        return "".join(out), new

    def _find_start(self, buf: str, p: int, final: bool) -> tuple[int, int | None]:
        """(i, marker length) when a region starts at ``buf[i]``, i >= p; (i, None) when none
        starts there and ``buf[p:i]`` is plain text (the rest is held)."""
        fmt = self._fmt
        if self._open is not None:
            return p, self._open.marker  # an open region: at the buffer's start, its marker passed
        if fmt.recipient and self._fresh:  # the reply's first recipient line has no marker
            if buf.startswith(fmt.opener, p):
                self._fresh = False
            elif not final and len(buf) - p < len(fmt.opener) and fmt.opener.startswith(buf[p:]):
                return p, None
            else:
                return p, 0
        if fmt.block is not None:
            found = [
                hit for hit in (self._openers.at(buf, max(p, self._skip)), self._dropped.at(buf, p)) if hit is not None
            ]
            if found:
                return min(found)
            return (len(buf) - (0 if final else held_back(buf, p, self._marks))), None
        if fmt.at_start or fmt.separator:
            m = NON_SPACE.search(buf, p)
            if m is not None:
                j = m.start()
                if fmt.at_start and buf[j] == "{" and not self._seen_text and not self.calls:
                    return j, 0
                if fmt.separator and self._after_call and buf.startswith(fmt.separator, j):
                    return j, len(fmt.separator)
        if fmt.opener:
            hit = self._openers.at(buf, p)
            if hit is not None:
                return hit
            if not final:
                return len(buf) - held_back(buf, p, (fmt.opener,)), None
        return len(buf), None

    def _region(self, buf: str, p: int, marker: int) -> Outcome:
        """A JSON region at ``buf[p]`` whose marker is ``marker`` characters: a wake while it
        is open; else (its end, its calls), no calls when it is not a valid call (its text up
        to the end is then content)."""
        fmt, st = self._fmt, self._open
        if st is None or st.span is None:
            m = NON_SPACE.search(buf, p + marker)
            if m is None:
                self._open = st or _Open(marker)
                return _Wake("nonspace")
            j = m.start()
            if buf[j] != ("[" if fmt.listed else "{"):
                return p + max(marker, 1), []  # the marker alone: content
            st = self._open = _Open(marker, json_at=j - p, span=JsonSpan())
            st.span.feed(buf, j)  # type: ignore[union-attr]
        assert st.span is not None
        if st.span.end is None:
            return _Wake("json", span=st.span)
        end = p + st.json_at + st.span.end
        value_text = buf[p + st.json_at:end]
        if fmt.closer:
            m = NON_SPACE.search(buf, end)
            if m is None:
                return _Wake("nonspace")
            k = m.start()
            rest = buf[k:k + len(fmt.closer)]
            if len(rest) < len(fmt.closer) and fmt.closer.startswith(rest):
                return _Wake("text")
            if rest != fmt.closer:
                return end, []
            end = k + len(fmt.closer)
        return end, self._calls_of(value_text)

    def _headed(self, buf: str, p: int, marker: int, final: bool) -> Outcome:
        """A headed call at ``buf[p]``: a recipient format's message (``marker`` 0: the reply's
        first, its marker in the prompt), its head a line, or Mistral's, its head the name (and
        the id) before ``args_mark``. A wake while it is open; (its line's end, None) for
        content's recipient (the line dropped); else (its end, its call), no call when it is not
        one (the marker is then content)."""
        fmt, st = self._fmt, self._open
        if st is None:
            at = p + marker
            mark = fmt.args_mark or "\n"
            k = buf.find(mark, at, at + MAX_HEAD + len(mark))
            if k < 0:
                if not final and len(buf) - at < MAX_HEAD + len(mark):
                    return _Wake("text")  # at most MAX_HEAD characters are looked at again
                self._fresh = False
                return at, []
            name, given = buf[at:k].strip(), ""
            self._fresh = False
            if fmt.recipient and name == fmt.recipient:
                return k + len(mark), None
            if fmt.id_mark and fmt.id_mark in name:
                name, given = (part.strip() for part in name.split(fmt.id_mark, 1))
                if not given or any(c.isspace() for c in given):
                    return at, []
            if (
                not name
                or any(c.isspace() for c in name)
                or (fmt.opener and fmt.opener in name)  # a marker again: the call starts there, if anywhere
                or (self._names is not None and name not in self._names)
            ):
                return at, []
            st = self._open = _Open(marker, name=name, head_end=k + len(mark) - p, given=given)
        if st.span is None:
            m = NON_SPACE.search(buf, p + st.head_end)
            if m is None:
                return _Wake("nonspace")
            j = m.start()
            if buf[j] != "{":
                return p + marker, []
            st.json_at, st.span = j - p, JsonSpan()
            st.span.feed(buf, j)
        if st.span.end is None:
            return _Wake("json", span=st.span)
        end = p + st.json_at + st.span.end
        try:
            args = read_bounded(buf[p + st.json_at:end])
        except ValueError:
            args = None
        arguments = written_arguments(args) if isinstance(args, dict) else None
        if arguments is None:
            return p + max(marker, len(fmt.opener) if buf.startswith(fmt.opener, p) else 0), []
        return end, [ToolCall(len(self.calls), st.given or self._new_id(), st.name, arguments)]

    def _block(self, buf: str, p: int, marker: int, final: bool) -> Outcome:
        """A family's block region (its ``Block``, families/) at ``buf[p]``: a wake while its closer (or the
        optional tail after it) may still come; else (its end, its calls)."""
        block = self._fmt.block
        assert block is not None
        opener = buf[p:p + marker]
        closer = block.closers[block.openers.index(opener)] if block.closers else block.closer
        st = self._open
        if st is None:
            st = self._open = _Open(marker, closer_from=marker)
        k = buf.find(closer, p + st.closer_from)
        if k < 0:
            st.closer_from = max(marker, len(buf) - p - len(closer) + 1)
            return _Wake("literal", closer, buf[max(p + marker, len(buf) - len(closer) + 1):])
        st.closer_from = k - p
        end = k + len(closer)
        if block.tail:
            m = NON_SPACE.search(buf, end)
            if m is None:
                if not final:
                    return _Wake("nonspace")
            else:
                j = m.start()
                rest = buf[j:j + len(block.tail)]
                if rest == block.tail:
                    end = j + len(block.tail)
                elif not final and len(rest) < len(block.tail) and block.tail.startswith(rest):
                    return _Wake("text")
        found = block.read(buf[p + marker:k], opener, self._props.get)
        written = [written_arguments(args) for _, args, _ in found or ()]
        if not found or None in written or (self._names is not None and any(n not in self._names for n, _, _ in found)):
            # Not calls: the opener is content. Of the openers inside, only the last can
            # begin a region of calls that ends at this closer (the others' would hold it):
            # trying each in turn would read the region again for each one.
            last = max(buf.rfind(o, p + marker, k) for o in block.openers)
            self._skip = last if last >= 0 else k
            return p + max(marker, 1), []
        base = len(self.calls)
        return end, [
            ToolCall(base + i, given or self._new_id(), name, arguments)
            for i, ((name, _, given), arguments) in enumerate(zip(found, written, strict=True))
        ]

    def _salvage(self, buf: str, p: int, marker: int) -> list[ToolCall]:
        """The whole calls of the open region at ``buf[p]`` the length cap cut (a list or a
        block of several calls, read up to its last whole call); none for a region of one call."""
        fmt = self._fmt
        if fmt.block is not None or fmt.headed:
            whole = self._block(buf, p, marker, True) if fmt.block is not None else self._headed(buf, p, marker, True)
            if not isinstance(whole, _Wake) and whole[1]:  # its call ended (a tail after it was cut)
                return whole[1]
        if fmt.block is not None:
            found = fmt.block.salvage(buf[p + marker:], buf[p:p + marker], self._props.get)
            written = [written_arguments(a) for _, a, _ in found or ()]
            if (
                not found
                or None in written
                or (self._names is not None and any(n not in self._names for n, _, _ in found))
            ):
                return []
            base = len(self.calls)
            return [
                ToolCall(base + i, given or self._new_id(), n, arguments)
                for i, ((n, _, given), arguments) in enumerate(zip(found, written, strict=True))
            ]
        st = self._open
        if st is None or st.json_at < 0 or not (fmt.listed or fmt.list_key):
            return []
        text, close = buf[p + st.json_at:], "]" if fmt.listed else "]}"
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
            value = read_bounded(text)
        except ValueError:
            return []
        fmt = self._fmt
        if fmt.list_key:
            value = value.get(fmt.list_key) if isinstance(value, dict) and len(value) == 1 else None
        items = value if fmt.listed or fmt.list_key else [value]
        if not isinstance(items, list) or not items:
            return []
        found: list[tuple[str, str]] = []
        for item in items:
            if not isinstance(item, dict):
                return []
            name = item.get("name")
            args = item.get(fmt.args_key, item.get("arguments" if fmt.args_key != "arguments" else "parameters"))
            if not isinstance(name, str) or not isinstance(args, dict):
                return []
            if self._names is not None and name not in self._names:
                return []
            arguments = written_arguments(args)
            if arguments is None:
                return []
            found.append((name, arguments))
        base = len(self.calls)
        return [ToolCall(base + i, self._new_id(), name, arguments) for i, (name, arguments) in enumerate(found)]

    def _text(self, text: str, out: list[str]) -> None:
        """Release ``text`` as content, holding its trailing whitespace: whitespace next to a
        call is dropped, any other is released with the text after it (or at the end)."""
        if not text:
            return
        core = text.strip()
        if not core:
            self._ws.append(text)
            return
        lead = len(text) - len(text.lstrip())
        if not self._after_call:
            out.extend(self._ws)
            out.append(text[:lead])
        out.append(core)
        self._ws.clear()
        self._ws.append(text[lead + len(core):])
        self._after_call = False
        self._seen_text = True
