"""Well-formed load: deterministic prompts, streaming completions sent and read on raw
sockets (every token-bearing event stamped as it arrives), and percentiles of what was timed.
Shared by the benchmarks (ceiling) and the hostile campaign's streams."""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .sse_reader import DONE, delta_text, sse_data


@dataclass
class Stream:
    """One streaming completion on its own raw socket, and what its reader saw so far."""

    sock: socket.socket
    request: bytes
    buf: bytearray = field(default_factory=bytearray)
    header_done: bool = False
    arrivals: list[float] = field(default_factory=list)  # one per token-bearing event
    tokens: int = 0  # from the final usage, else the events counted
    done: bool = False
    error: str = ""


def completion_request(port: int, prompt: str, n_tokens: int, sampling: dict[str, Any] | None = None) -> bytes:
    """A whole HTTP/1.1 request for a greedy streaming ``/v1/completions`` of ``n_tokens``
    (``ignore_eos``: every stream runs its full length), closed after its reply; ``sampling``:
    keys that replace greedy's (temperature, seed, ...)."""
    body = json.dumps(
        {
            "prompt": prompt,
            "max_tokens": n_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(sampling or {}),
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head + body


def consume(s: Stream, now: float) -> None:
    """Parse what arrived: SSE events (chunked transfer framing is skipped line by line)."""
    if not s.header_done:
        end = s.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        status = bytes(s.buf[: s.buf.find(b"\r\n")])
        if b" 200 " not in status:
            s.error = status.decode(errors="replace")
        del s.buf[: end + 4]
        s.header_done = True
    while True:
        end = s.buf.find(b"\n\n")
        if end < 0:
            return
        event = bytes(s.buf[:end])
        del s.buf[: end + 2]
        for line in event.split(b"\n"):
            data = sse_data(line.strip().decode(errors="replace"))
            if data is None:
                continue
            if data.strip() == DONE:
                s.done = True
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                continue
            usage = obj.get("usage")
            if usage:
                s.tokens = usage.get("completion_tokens", s.tokens)
            if delta_text(obj):
                s.arrivals.append(now)


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile, linearly interpolated (NaN for no values)."""
    vals = sorted(values)
    if not vals:
        return float("nan")
    k = (len(vals) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def words_prompt(n_words: int, seed: int = 0) -> str:
    """Deterministic English-looking text; the synthetic vocabulary tokenizes it ~1 token/word."""
    from hydra_trio.model.synthetic import _WORDS

    out = []
    x = seed * 2654435761 + 12345
    for _ in range(n_words):
        x = (x * 6364136223846793005 + 1442695040888963407) & ((1 << 64) - 1)
        out.append(_WORDS[(x >> 33) % len(_WORDS)])
    return " ".join(out)
