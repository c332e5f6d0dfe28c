"""The one streaming event machine of the agents' dialects (Anthropic's Messages, OpenAI's
Responses). A reply's parsed pieces become blocks: a run of reasoning, a run of text, each
tool call whole. The machine decides when a block opens, grows and closes; the dialect's
event table (``EventTable``) says, as data, which events each step is: an event's type and
its fields, framed here one way (``event: TYPE`` and ``data: {"type": TYPE, ...}``, with a
``sequence_number`` where the table numbers them)."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from ...engine import GenerationResult, ReplyParser, ToolCall
from ..plumbing import named_event
from .generation import StreamEvents
from .replies import Piece, cut, delta_pieces

Event = tuple[str, dict[str, Any]]  # an event's type and its fields


class EventTable(Protocol):
    """A dialect's events at each step of one reply's stream (``index``: the block's, from 0;
    ``kind``: "reasoning" or "text")."""

    numbered: ClassVar[bool]  # each event carries its sequence_number

    def start(self) -> list[Event]: ...  # the stream's head

    def open(self, index: int, kind: str) -> list[Event]: ...  # a run of reasoning or text begins

    def text(self, index: int, kind: str, text: str) -> list[Event]: ...  # the run grows by text

    def close(self, index: int, kind: str, text: str) -> list[Event]: ...  # the run ends (text: all of it)

    def call(self, index: int, call: ToolCall) -> list[Event]: ...  # a tool call, whole

    def end(self, res: GenerationResult, calls: bool) -> list[Event]: ...  # the reply ended (calls: it made some)

    def failed(self, exc: BaseException) -> list[Event]: ...  # it failed after its 200


class BlockStream:
    """One reply's event stream under ``table``: ``head``, then ``delta(text)`` for each text
    piece (read by ``parser``; None: the text is the content), ``done(res)`` at the end, or
    ``error(exc)``. ``events()``: the same as a generation's ``StreamEvents``."""

    def __init__(self, table: EventTable, parser: ReplyParser | None) -> None:
        self.table, self.parser = table, parser
        self._seq = 0  # the next event's sequence number
        self._blocks = 0  # blocks begun: the last one's index is this less one
        self._open: str | None = None  # the kind of the open run: "reasoning" or "text"
        self._text = ""  # the open run's text so far
        self._calls = False
        self.head = self._write(table.start())

    def _write(self, events: list[Event]) -> bytes:
        out = []
        for kind, fields in events:
            payload = (
                {"type": kind, "sequence_number": self._seq, **fields}
                if self.table.numbered
                else {"type": kind, **fields}
            )
            self._seq += 1
            out.append(named_event(kind, payload))
        return b"".join(out)

    def _begin(self) -> int:
        self._blocks += 1
        return self._blocks - 1

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        kind, text = self._open, self._text
        self._open, self._text = None, ""
        return self._write(self.table.close(self._blocks - 1, kind, text))

    def _pieces(self, pieces: list[Piece]) -> bytes:
        out = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                out.append(self._close())
                self._calls = True
                out.append(self._write(self.table.call(self._begin(), piece)))
                continue
            kind, text = piece
            if self._open != kind:
                out.append(self._close())
                self._open = kind
                out.append(self._write(self.table.open(self._begin(), kind)))
            self._text += text
            out.append(self._write(self.table.text(self._blocks - 1, kind, text)))
        return b"".join(out)

    def delta(self, text: str) -> bytes:
        if self.parser is None:
            return self._pieces([("text", text)] if text else [])
        return self._pieces(delta_pieces(self.parser.feed(text)))

    def done(self, res: GenerationResult) -> bytes:
        rest = b"" if self.parser is None else self._pieces(delta_pieces(self.parser.finish(cut=cut(res))))
        return rest + self._close() + self._write(self.table.end(res, self._calls))

    def error(self, exc: BaseException) -> bytes:
        return self._write(self.table.failed(exc))

    def events(self) -> StreamEvents:
        """As a generation's stream events: the agents' dialects end with their own last
        event (no ``[DONE]``), and a parsed reply's event depends on what came before (the
        producer never writes one itself)."""
        return StreamEvents(head=self.head, delta=self.delta, done=self.done, direct=False, end=b"", error=self.error)
