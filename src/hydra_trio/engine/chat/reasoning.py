"""A reply's reasoning: the text between ``<think>`` and ``</think>`` split from its content,
incrementally (streamed pieces give exactly what the whole reply gives). Pure."""

from __future__ import annotations

from typing import Literal

from .markup import NON_SPACE, partial_suffix

OPEN, CLOSE = "<think>", "</think>"


class ThinkSplitter:
    """Splits a reply into (reasoning, content). A reply that opens (after whitespace) with
    ``<think>``, or one whose prompt ended inside an open think block, has its text up to
    ``</think>`` as reasoning, without the tags and one newline on each side; the content
    after it starts at its first non-whitespace character."""

    def __init__(
        self, *, starts_in_reasoning: bool = False, tags: tuple[str, str] = (OPEN, CLOSE), lead: str = ""
    ) -> None:
        # ``tags``: the family's think markers (``<think>``, Seed-OSS's ``<seed:think>``, ...)
        self._open, self._close = tags
        # ``lead``: what the prompt wrote in the block it opened, when that is the reasoning's
        # start (Apriel 1.6's "Here are my reasoning steps:\n": llama.cpp parses the generation
        # prompt with the reply and reports it); the reasoning then keeps its first newline.
        self._lead = lead
        self._state: Literal["start", "think", "after", "content"] = "think" if starts_in_reasoning else "start"
        self._buf = ""
        self._space: list[str] = []  # the reply's leading whitespace, while it may precede the open tag
        self._first = True  # no reasoning emitted yet: its one leading newline is dropped

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) releasable after ``text``."""
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            buf = self._buf
            if self._state == "start":
                # Whitespace is set aside (not looked at again), the text after it held.
                m = NON_SPACE.search(buf)
                if m is None:
                    self._space.append(buf)
                    self._buf = ""
                    break
                lead = buf[m.start():]
                if lead.startswith(self._open):
                    self._space.clear()
                    self._state, self._buf = "think", lead[len(self._open):]
                elif self._open.startswith(lead):
                    self._space.append(buf[:m.start()])
                    self._buf = lead
                    break  # the start of the tag: wait for more
                else:
                    self._state, self._buf = "content", "".join((*self._space, buf))
                    self._space.clear()
            elif self._state == "think":
                end = buf.find(self._close)
                if end >= 0:
                    said = buf[:end]
                    reasoning.append(self._reasoning(said[:-1] if said.endswith("\n") else said))
                    reasoning.append(self._unsaid_lead())
                    self._state, self._buf = "after", buf[end + len(self._close):]
                else:
                    keep = partial_suffix(buf, "\n" + self._close, self._close)
                    reasoning.append(self._reasoning(buf[: len(buf) - keep]))
                    self._buf = buf[len(buf) - keep:]
                    break
            elif self._state == "after":
                lead = buf.lstrip()
                self._buf = lead
                if not lead:
                    break
                self._state = "content"
            else:
                content.append(buf)
                self._buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is held at the reply's end: an unclosed think block's text is reasoning; a
        reply that was only whitespace or the start of the tag is content."""
        buf, self._buf = "".join((*self._space, self._buf)), ""
        self._space.clear()
        if self._state == "think":
            return self._reasoning(buf) + self._unsaid_lead(), ""
        if self._state == "after":
            return "", ""
        return "", buf

    def _reasoning(self, text: str) -> str:
        if text and self._first:
            self._first = False
            if self._lead:
                return self._lead + text
            return text[1:] if text.startswith("\n") else text
        return text

    def _unsaid_lead(self) -> str:
        """The lead, where the block closes with no reasoning of the reply's own (trimmed, as
        llama.cpp trims reasoning)."""
        if self._first and self._lead:
            self._first = False
            return self._lead.rstrip()
        return ""
