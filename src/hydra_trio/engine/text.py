"""Token bytes -> streamed text: incremental UTF-8 and stop strings that may span tokens."""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextAssembler:
    """Feeds token bytes in, gives out text that is safe to send.

    Text that could still turn into a stop string is held back until it cannot, so a
    streaming client never sees part of a stop string; a multi-byte character split over
    tokens is sent once complete.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._text = ""  # everything decoded so far (final text once stopped)
        self._sent = 0  # chars of _text already handed out
        self.stopped_by: str | None = None

    @property
    def text(self) -> str:
        return self._text

    def push(self, data: bytes) -> str:
        """Add a token's bytes; return the text that may be sent now ('' if none)."""
        if self.stopped_by is not None:
            return ""
        self._text += self._decoder.decode(data)
        if not self._stop:
            return self._take(len(self._text))
        # A stop string can only start in the held-back tail or the new text.
        search_from = max(0, self._sent - max(len(s) for s in self._stop) + 1)
        first: tuple[int, str] | None = None
        for s in self._stop:
            i = self._text.find(s, search_from)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self.stopped_by = first[1]
            self._text = self._text[: first[0]]
            return self._take(len(self._text))
        return self._take(len(self._text) - self._held_back())

    def finish(self) -> str:
        """End of generation: flush an incomplete character and any held-back text."""
        if self.stopped_by is None:
            self._text += self._decoder.decode(b"", final=True)
        return self._take(len(self._text))

    def _held_back(self) -> int:
        # Longest suffix of the text that is a proper prefix of some stop string.
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _take(self, end: int) -> str:
        end = max(end, self._sent)
        out = self._text[self._sent : end]
        self._sent = end
        return out


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
