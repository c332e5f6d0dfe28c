"""TextAssembler: streamed text equals the final text, stop strings never leak, UTF-8 split
across tokens is reassembled."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_trio.engine.text import TextAssembler, common_prefix_len


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
    streamed, asm = _feed(_split(text.encode(), cuts), [])
    assert streamed == text == asm.text


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
    assert asm.text == "hello </extra "


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
