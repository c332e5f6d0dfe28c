"""TextAssembler: streamed text equals the final text, stop strings never leak, UTF-8 split
across tokens is reassembled."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_trio.engine.llama import common_prefix_len
from hydra_trio.engine.text import TextAssembler


def _feed(pieces: list[bytes], stop: list[str]) -> tuple[str, TextAssembler]:
    asm = TextAssembler(stop)
    out = []
    for p in pieces:
        out.append(asm.push(p))
        if asm.stopped_by is not None:
            break
    out.append(asm.finish())
    return "".join(out), asm


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in points:
        pieces.append(data[last:p])
        last = p
    pieces.append(data[last:])
    return pieces


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.text(max_size=40), st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_streamed_text_is_the_text_whatever_the_token_boundaries(text: str, cuts: list[int]) -> None:
    streamed, _ = _feed(_split(text.encode(), cuts), [])
    assert streamed == text


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    st.text(alphabet="abc\u00e9\u4e2d", max_size=30),
    st.sampled_from(["ab", "c\u00e9", "\u4e2da", "cc"]),
    st.lists(st.integers(min_value=0, max_value=100), max_size=10),
)
def test_stop_string_cuts_the_text_and_never_leaks(text: str, stop: str, cuts: list[int]) -> None:
    streamed, asm = _feed(_split(text.encode(), cuts), [stop])
    if stop in text:
        assert asm.stopped_by == stop
        assert streamed == text[: text.index(stop)]
    else:
        assert asm.stopped_by is None
        assert streamed == text
    assert stop not in streamed


def test_partial_stop_is_held_back_until_resolved() -> None:
    asm = TextAssembler(["</end>"])
    assert asm.push(b"hello </e") == "hello "
    assert asm.push(b"xtra") == "</extra"
    assert asm.push(b" </end> tail") == " "
    assert asm.stopped_by == "</end>"
    assert asm.push(b"more") == "" and asm.finish() == ""


def test_invalid_utf8_becomes_replacement_characters() -> None:
    asm = TextAssembler()
    assert asm.push(b"\xe4\xb8") == ""  # first two bytes of a 3-byte character: held
    assert asm.push(b"\xad!") == "\u4e2d!"
    assert asm.push(b"\xff") == "\ufffd"
    assert asm.push(b"\xe4") == ""
    assert asm.finish() == "\ufffd"  # an incomplete character at the end


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2


class _WholeTextAssembler:
    """The first implementation, kept as the oracle: it searched and held back over the
    whole text so far (O(text) per token)."""

    def __init__(self, stop: list[str]) -> None:
        import codecs

        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._text, self._sent, self.stopped_by = "", 0, None

    def push(self, data: bytes) -> str:
        if self.stopped_by is not None:
            return ""
        self._text += self._decoder.decode(data)
        if not self._stop:
            return self._take(len(self._text))
        search_from = max(0, self._sent - max(len(s) for s in self._stop) + 1)
        found = [(i, s) for s in self._stop if (i := self._text.find(s, search_from)) >= 0]
        if found:
            i, s = min(found, key=lambda f: f[0])
            self.stopped_by, self._text = s, self._text[:i]
            return self._take(len(self._text))
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:k]):
                    best = k
                    break
        return self._take(len(self._text) - best)

    def finish(self) -> str:
        if self.stopped_by is None:
            self._text += self._decoder.decode(b"", final=True)
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        end = max(end, self._sent)
        out, self._sent = self._text[self._sent : end], end
        return out


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(
    st.text(alphabet="ab\u00e9c", max_size=40),
    st.lists(st.text(alphabet="ab\u00e9c", min_size=1, max_size=6), min_size=1, max_size=4),
    st.lists(st.integers(min_value=0, max_value=100), max_size=12),
)
def test_windowed_assembler_gives_what_the_whole_text_one_gave(text: str, stops: list[str], cuts: list[int]) -> None:
    """Every chunk handed out, and the stop, as the whole-text implementation decided them,
    for several stops that overlap and share prefixes, whatever the token boundaries."""
    new, old = TextAssembler(stops), _WholeTextAssembler(stops)
    for piece in _split(text.encode(), cuts):
        assert new.push(piece) == old.push(piece)
    assert new.finish() == old.finish()
    assert new.stopped_by == old.stopped_by
