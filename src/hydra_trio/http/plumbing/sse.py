"""Server-sent events (OpenAI's ``data:`` framing, the agents' dialects' named events) and the
one error shape of every HTTP route, the "busy, retry" reply's among them."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def named_event(kind: str, payload: dict[str, Any]) -> bytes:
    """A named event (``event: KIND``) with its JSON, the agents' dialects' framing."""
    return (
        f"event: {kind}\ndata: ".encode()
        + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        + b"\n\n"
    )


_HOLE = "\x00text\x00"  # a string no chunk holds: json writes it as \u0000text\u0000


def sse_text_events(chunk: dict[str, Any]) -> Callable[[str], bytes]:
    """``text -> sse_event(chunk with text in place of the hole)``, byte for byte, without
    serialising the chunk's constant fields again for every token (``chunk`` holds the
    string ``HOLE`` where the text goes)."""
    head, tail = sse_event(chunk).split(json.dumps(_HOLE).encode())
    dumps = json.JSONEncoder(ensure_ascii=False).encode
    return lambda text: head + dumps(text).encode() + tail


HOLE = _HOLE


def wants_sse(accept: str | None) -> bool:
    return "text/event-stream" in (accept or "").lower()


def error_body(status: int, message: str, kind: str, *, param: str | None = None, **extra: Any) -> dict[str, Any]:
    """The one error shape of every HTTP route: OpenAI's ``{"error": {message, type, param,
    code}}``, with ``code`` the HTTP status (as llama-server sends it) and ``param`` the
    refused request parameter, when one is to blame. ``extra`` goes beside ``error``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}, **extra}


# Every "busy, retry" reply (503) tells the client when to come back.
RETRY_AFTER = {"Retry-After": "1"}


def busy_body(message: str, **extra: Any) -> dict[str, Any]:
    """The body of the one "busy, retry" reply (503 with ``RETRY_AFTER``): the engine is
    loading, draining, out of slots, of payload room or of connections."""
    return error_body(503, message, "unavailable_error", **extra)


