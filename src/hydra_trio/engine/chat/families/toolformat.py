"""What a tool-call family is: a ``ToolFormat`` (the one home of its syntax, read by both
readers of it: ``parser.ReplyParser`` takes its markers, ``call_grammar.tools_grammar`` writes
its grammar and lazy triggers, so what the grammar makes a model write is what the parser
takes as a call), the ``Detect`` rules that pick it from a chat template's source, and the
``Block`` of a family whose calls are regions of its own markup. Pure."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ...structured import SchemaExpr, trigger_pattern
from ..tools import Tool

# How the grammar writes a call's JSON, up to the tool's name: ``{"name": "N", "<args>": {...}}``
# (the spacing of the models' own examples). A lazy trigger may land inside this text.
CALL_PREFIX = '{"name": "'

Call = tuple[str, dict[str, Any], str | None]  # (name, arguments, the id the model wrote or None)
Props = Mapping[str, Mapping[str, Any]]  # a tool's parameters' properties: name -> schema
Reader = Callable[[str, str, Callable[[str], Props | None]], list[Call] | None]
# One call's grammar: (tool, its index, its schemas' expressions) -> (the call's expression, rules)
CallRule = Callable[[Tool, int, SchemaExpr], tuple[str, list[str]]]
# A format's lazy patterns that name the request's tools: (format, tool names) -> patterns
ToolPatterns = Callable[["ToolFormat", list[str]], tuple[str, ...]]
Accept = Callable[[str, dict[str, Any]], str | None]  # (name, arguments) -> written arguments; None: not a call


class ChannelReader(Protocol):
    """A channel dialect's reader of one reply (channels.py ``ChannelSplitter``): each feed's
    (reasoning, content, calls as (name, written arguments)) releasable so far."""

    def feed(self, text: str, *, final: bool = False, cut: bool = False) -> tuple[str, str, list[tuple[str, str]]]: ...


class NewChannelReader(Protocol):
    """What makes a dialect's reader: ``reasoning`` split out, ``parse_tools`` calls read,
    ``accept`` a call's arguments written out (None: not a call), ``props_of`` a tool's parameters."""

    def __call__(
        self, *, reasoning: bool, parse_tools: bool, accept: Accept, props_of: Callable[[str], Props | None]
    ) -> ChannelReader: ...

MAX_SALVAGE_TRIES = 64  # places a cut block's last whole call is looked for (a nested "}" is no call's end)


@dataclass(frozen=True)
class Trigger:
    """A literal whose appearance in the reply starts the tool grammar (``auto``)."""

    text: str
    at_start: bool  # only as the reply's first non-whitespace text
    then: str  # the fixed text the grammar writes right after it

    @property
    def pattern(self) -> str:
        """The trigger as the lazy grammar's pattern (structured/triggers.py)."""
        return trigger_pattern(self.text, self.at_start, self.then)


@dataclass(frozen=True)
class Detect:
    """A template whose Jinja source holds every one of ``marks`` writes calls in this
    format. Rules are tried in ``priority`` order, lowest first, the first that holds
    wins (``roster.detection_order``): several families write ``<tool_call>`` (Hermes'
    JSON, Qwen3-Coder's ``<function=``, GLM's ``<arg_key>``), so the more specific come
    first. Each priority is one rule's alone."""

    priority: int
    marks: tuple[str, ...]

    def holds(self, source: str) -> bool:
        return all(m in source for m in self.marks)


@dataclass(frozen=True)
class Block:
    """A region of calls: it starts at one of ``openers`` and ends at ``closer`` (then an
    optional ``tail``, with whitespace before it, is part of it too). ``read`` gets the text
    between opener and closer and the opener; it returns the calls, or None when the region
    is not valid calls (its text is then content)."""

    openers: tuple[str, ...]
    closer: str
    read: Reader
    tail: str = ""
    closers: tuple[str, ...] = ()  # when given: the closer of each opener (DSML's two spellings)
    # A block of several calls: what ends each call in it, and what closes the calls' list
    # after one (a JSON list's "]"): a block the length cap cut is read up to its last whole
    # call (``salvage``). "": a block holds one call.
    call_end: str = ""
    list_close: str = ""

    def salvage(self, body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
        """The whole calls of a block cut before its closer (the length cap): its text up to
        the last call that ends, read as if the block closed there; None: none is whole."""
        end = len(body)
        for _ in range(MAX_SALVAGE_TRIES):
            k = body.rfind(self.call_end, 0, end) if self.call_end else -1
            if k < 0:
                return None
            calls = self.read(body[: k + len(self.call_end)] + self.list_close, opener, props_of)
            if calls:
                return calls
            end = k
        return None


@dataclass(frozen=True)
class ToolFormat:
    """One way of writing calls. A call whose syntax is a JSON object needs only the fields
    of the first group (the parser's JSON regions, the grammar's default call); a family
    with markup of its own brings its ``block`` (the reader) and its ``call_rule`` (the
    grammar), a recipient family (Functionary) its ``recipient``, a channel dialect
    (gpt-oss, Muse Glimmer) its ``splitter``."""

    name: str  # the --tool-call-parser name
    args_key: str  # the call object's key for the arguments
    # What the parser looks for:
    opener: str = ""  # a literal that starts calls anywhere in the text ("": none)
    closer: str = ""  # a literal after each call's JSON
    at_start: bool = False  # a JSON object opening the reply is a call (or the calls' object)
    listed: bool = False  # after the opener, the calls are one JSON array
    list_key: str = ""  # the calls are this key's array of one JSON object (generic)
    separator: str = ""  # between one call's JSON and the next (llama3's ";")
    # What the grammar writes: before all calls, around each, between two, after all.
    before: str = ""
    before_optional: bool = False
    call_open: str = ""
    call_close: str = ""
    between: str = ""
    after: str = ""
    triggers: tuple[Trigger, ...] = ()
    # Which templates write this format (``Detect``; none: it is only named, or the fallback).
    detect: tuple[Detect, ...] = ()
    # A family whose calls are blocks of its own markup: the parser reads them with ``block.read``.
    block: Block | None = None
    # One call's grammar, where it is not the JSON object ``{"name": "N", ARGS_KEY: ARGS}``.
    call_rule: CallRule | None = None
    one_call: bool = False  # a reply holds one call at most (gpt-oss stops at ``<|call|>``)
    # Functionary v3.2's recipients: each message starts at ``opener`` with its recipient's
    # line (the reply's first one right at its start: the prompt ends with the opener);
    # ``all`` is content (the line dropped), a tool's name a call whose arguments' JSON follows.
    recipient: str = ""
    # Mistral's named calls, each ``opener`` NAME ``args_mark`` and the arguments' JSON, no closer
    # (``[TOOL_CALLS]NAME[ARGS]{...}``): with ``id_mark``, the name may be followed by it and the
    # id the model wrote, which the call keeps (``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}``).
    args_mark: str = ""
    id_mark: str = ""
    dropped: tuple[str, ...] = ()  # markup around content (a block family's), removed from it
    # A trigger per declared tool (text, then), "{name}" its name: where the call's start names it
    tool_trigger: tuple[str, str] = ()
    tool_patterns: ToolPatterns | None = None  # lazy patterns of its own, naming the request's tools
    # A channel dialect, whose messages carry reasoning, content and calls alike: its splitter
    # reads the reply, not the scanner (a ``channels.ChannelSplitter``).
    splitter: NewChannelReader | None = None
    marks: tuple[str, ...] = ()  # more literals of its syntax (a dialect's message markers)

    @property
    def headed(self) -> bool:
        """Each call is a head (a recipient's line, a name before ``args_mark``) after the
        opener, then its arguments' JSON, which ends it."""
        return bool(self.recipient or self.args_mark)

    @property
    def channels(self) -> bool:
        """A channel dialect: reasoning is a channel of its messages, not a think block."""
        return self.splitter is not None

    def syntax_text(self) -> tuple[str, ...]:
        """Every literal the format's calls are written with (markers, and the fixed text the
        grammar writes): a model's special token spelled inside one is part of the syntax, so
        a reply shows it as text for the parser (as llama-server's ``preserved_tokens``)."""
        parts = [self.opener, self.closer, self.before, self.call_open, self.call_close, self.after, self.args_mark,
                 self.id_mark]
        parts += [t.text + t.then for t in self.triggers]
        if self.block is not None:
            parts += [*self.block.openers, self.block.closer, self.block.tail, *self.block.closers, *self.dropped]
        parts += self.marks
        return tuple(p for p in parts if p)


def json_list(name: str, opener: str, closer: str = "", *, detect: tuple[Detect, ...] = ()) -> ToolFormat:
    """A format whose calls are one JSON list after ``opener`` (and before ``closer``):
    ``OPENER[{"name": ..., "arguments": {...}}, ...]CLOSER``."""
    return ToolFormat(
        name,
        "arguments",
        opener=opener,
        closer=closer,
        listed=True,
        before=opener + "[",
        between=", ",
        after="]" + closer,
        triggers=(Trigger(opener, False, "[" + CALL_PREFIX),),
        detect=detect,
    )
