"""SSE chunks built from a template are byte-identical to serialising the whole chunk."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hydra_trio.http.completions import completion_chunk
from hydra_trio.http.plumbing import HOLE, sse_event, sse_text_events


@given(st.text())
def test_templated_chunk_equals_the_serialised_chunk(text: str) -> None:
    event = sse_text_events(completion_chunk("chatcmpl-x", 7, "m\"odel", delta={"content": HOLE}))
    assert event(text) == sse_event(completion_chunk("chatcmpl-x", 7, "m\"odel", delta={"content": text}))
