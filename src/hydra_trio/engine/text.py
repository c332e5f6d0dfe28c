"""Token bytes -> streamed text: incremental UTF-8 and stop strings that may span tokens."""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextAssembler:
    """Feeds token bytes in, gives out text that is safe to send.

    Text that could still turn into a stop string is held back until it cannot, so a
    streaming client never sees part of a stop string; a multi-byte character split over
    tokens is sent once complete. Each stop string is followed by a KMP matcher as the text
    streams, so a token costs O(its characters x stop strings), whatever the text so far or
    the stops' lengths.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._fail = [_failure(s) for s in self._stop]
        self._matched = [0] * len(self._stop)  # per stop: its longest prefix the text ends with
        self._pending = ""  # decoded, not handed out: the held-back tail
        self.stopped_by: str | None = None

    def push(self, data: bytes) -> str:
        """Add a token's bytes; return the text that may be sent now ('' if none)."""
        if self.stopped_by is not None:
            return ""
        new = self._decoder.decode(data)
        if not self._stop:
            return new
        base = len(self._pending)  # where ``new`` starts in pending + new
        first: tuple[int, int] | None = None  # (start in pending + new, stop index)
        for j, (stop, fail) in enumerate(zip(self._stop, self._fail, strict=True)):
            k = self._matched[j]
            for i, ch in enumerate(new):
                while k and stop[k] != ch:
                    k = fail[k - 1]
                if stop[k] == ch:
                    k += 1
                if k == len(stop):
                    start = base + i + 1 - k  # may lie in text already handed out (< 0)
                    if first is None or start < first[0]:
                        first = (start, j)
                    break
            self._matched[j] = k
        text = self._pending + new
        if first is not None:
            self.stopped_by = self._stop[first[1]]
            self._pending = ""
            return text[: max(first[0], 0)]
        held = min(max(self._matched), len(text))
        self._pending = text[len(text) - held :] if held else ""
        return text[: len(text) - held]

    def finish(self) -> str:
        """End of generation: flush an incomplete character and any held-back text."""
        if self.stopped_by is not None:
            return ""
        out = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return out


def _failure(pattern: str) -> list[int]:
    """KMP: for each prefix of ``pattern``, the length of its longest proper prefix that is
    also its suffix."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail
