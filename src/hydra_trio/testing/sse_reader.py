"""The one SSE reader: the ``data:`` lines of an OpenAI-style stream (``/v1/chat/completions``,
``/v1/completions``, ``/v1/decode/{id}``), as tests and benchmarks read them."""

from __future__ import annotations

import json
from typing import Any

DONE = "[DONE]"


def sse_data(line: str) -> str | None:
    """The payload of a ``data:`` line (``[DONE]`` included; one space after the colon is
    dropped, as the SSE spec says: other servers omit it), else None (blank, comment)."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :]
    return data[1:] if data.startswith(" ") else data


def sse_chunk(line: str) -> dict[str, Any] | None:
    """The JSON chunk of a ``data: `` line; None for any other line and for ``[DONE]``."""
    data = sse_data(line)
    return None if data is None or data == DONE else json.loads(data)


def delta_text(chunk: dict[str, Any]) -> str:
    """The text a chunk adds: its first choice's ``delta.content`` (chat) or ``text``
    (completions); "" when it carries none (a role, usage, a tool call)."""
    choices = chunk.get("choices") or [{}]
    first = choices[0]
    return (first.get("delta") or {}).get("content") or first.get("text") or ""


def parse_sse(lines: list[str]) -> tuple[list[dict[str, Any]], bool]:
    """(events, saw [DONE]) from the lines of an SSE body, strictly: every non-blank line is a
    ``data:`` line and nothing comes after ``[DONE]`` (AssertionError otherwise: the tests'
    reader)."""
    events: list[dict[str, Any]] = []
    done = False
    for line in lines:
        if not line:
            continue
        data = sse_data(line)
        assert data is not None, f"unexpected SSE line {line!r}"
        assert not done, "event after [DONE]"
        if data == DONE:
            done = True
            continue
        events.append(json.loads(data))
    return events, done


def sse_text(events: list[dict[str, Any]]) -> str:
    """The chat text of a stream's events (``delta.content`` of the first choice)."""
    return "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")
    )
