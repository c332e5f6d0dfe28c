"""A streamed completion's text written by its producer straight to the socket (http/
connections.py ``ChunkWriter``, http/generation/generation.py), and a DECODE result stream's by its
generating task (http/decode_results/decode_routes.py): the bytes are HTTP/1.1 chunks as h11 frames them,
whole and in order however little the socket takes at a time; HTTP/1.0 keeps Hypercorn's
path."""

from __future__ import annotations

import json
from typing import Any

import h11
import trio
import trio.testing

from helpers import (
    MESSAGES,
    Collected,
    decode_ok,
    frame,
    gate,
    get_result,
    http,
    parse_sse,
    read_sse,
    rpc,
    sse_text,
    text_of,
)
from hydra_trio.http.generation import generation
from hydra_trio.http.plumbing import ChunkWriter, connections

N_TOKENS = 24


def _request(port: int, version: str) -> bytes:
    body = json.dumps(
        {"prompt": "the quick brown fox", "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    ).encode()
    return (
        f"POST /v1/completions HTTP/{version}\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


async def _exchange(port: int, version: str = "1.1") -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Send a streamed completion request and read the reply to EOF: (status, headers,
    body). An HTTP/1.1 reply is parsed as a client would (h11 raises on any framing error);
    an HTTP/1.0 one is its bytes after the head."""
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    await stream.send_all(_request(port, version))
    raw = bytearray()
    with trio.fail_after(60):
        while chunk := await stream.receive_some(1 << 16):
            raw += chunk
    await stream.aclose()
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target="/v1/completions", headers=[("Host", "x")]))
    client.receive_data(bytes(raw))
    client.receive_data(b"")
    response = client.next_event()
    assert isinstance(response, h11.Response)
    if version == "1.0":
        return response.status_code, list(response.headers), bytes(raw[raw.index(b"\r\n\r\n") + 4 :])
    body = bytearray()
    while not isinstance(event := client.next_event(), h11.EndOfMessage):
        assert isinstance(event, h11.Data), event
        body += event.data
    return response.status_code, list(response.headers), bytes(body)


def _check_events(body: bytes, generated: list[str]) -> None:
    """Whole SSE events: the text deltas, which join into what the engine generated
    (nothing lost, repeated or out of order), the final one with the usage, then [DONE]."""
    events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == N_TOKENS
    streamed = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert streamed and streamed == generated.pop(0)


def _watch_generations(engine: Any, monkeypatch: Any) -> list[str]:
    """The text of each generation as the engine recorded it when it ended."""
    texts: list[str] = []
    metrics = engine.state.metrics
    real = metrics.record_generation

    def record(path: str, res: Any, **kw: Any) -> None:
        texts.append("".join(res.text_parts))
        real(path, res, **kw)

    monkeypatch.setattr(metrics, "record_generation", record)
    return texts


def _watch_writers(monkeypatch: Any) -> list[ChunkWriter | None]:
    """What chunk_writer gave each streamed request."""
    given: list[ChunkWriter | None] = []
    real = generation.chunk_writer

    def watched() -> ChunkWriter | None:
        w = real()
        given.append(w)
        return w

    monkeypatch.setattr(generation, "chunk_writer", watched)
    return given


async def test_an_http11_stream_gets_a_chunk_writer_and_valid_chunks(engine: Any, monkeypatch: Any) -> None:
    assert connections.chunk_writer() is None  # outside any connection
    given, generated = _watch_writers(monkeypatch), _watch_generations(engine, monkeypatch)
    status, headers, body = await _exchange(engine.http_port)
    assert status == 200
    assert (b"transfer-encoding", b"chunked") in headers
    assert len(given) == 1 and given[0] is not None
    _check_events(body, generated)


async def test_an_http10_stream_keeps_hypercorns_path(engine: Any, monkeypatch: Any) -> None:
    # No chunked framing to an HTTP/1.0 peer: the body runs to the connection's close.
    given, generated = _watch_writers(monkeypatch), _watch_generations(engine, monkeypatch)
    status, headers, body = await _exchange(engine.http_port, "1.0")
    assert status == 200 and b"transfer-encoding" not in dict(headers)
    assert given == [None]
    _check_events(body, generated)


async def test_a_stream_arrives_whole_when_every_write_takes_only_a_few_bytes(engine: Any, monkeypatch: Any) -> None:
    # Each write takes at most 7 bytes: every chunk the producer begins leaves the rest to the
    # body's reader, and every chunk Hypercorn sends takes its waiting path.
    real = connections._send_now
    monkeypatch.setattr(connections, "_send_now", lambda stream, data: real(stream, data[:7]))
    rests = 0
    real_rest = ChunkWriter.send_rest

    async def counted(self: ChunkWriter, rest: bytes) -> None:
        nonlocal rests
        rests += 1
        await real_rest(self, rest)

    monkeypatch.setattr(ChunkWriter, "send_rest", counted)
    generated = _watch_generations(engine, monkeypatch)
    for _ in range(2):  # the second on a slot that holds the first's history
        status, _, body = await _exchange(engine.http_port)
        assert status == 200
        _check_events(body, generated)
    # Which tokens go straight out depends on the order trio runs the producer and the reader
    # in (it varies it on purpose), but each of the 48 tokens is a chance.
    assert rests > 0


# ---- the DECODE result stream: the generating task writes while the reader waits -------------


async def _decode_stream(ep: Any, monkeypatch: Any, *, max_write: int | None) -> tuple[int, int]:
    """A DECODE read over SSE by one reader, generation stepped one token at a time (the
    worker held between steps, so the reader waits up to date at each token): the chunks
    ChunkWriter began for it, and the rests the reader then sent. Checks the stream whole."""
    began = rests = 0
    real_now, real_rest, real_send = ChunkWriter.send_now, ChunkWriter.send_rest, connections._send_now

    def send_now(self: ChunkWriter, data: bytes) -> bytes | None:
        nonlocal began
        left = real_now(self, data)
        began += left is not None
        return left

    async def send_rest(self: ChunkWriter, rest: bytes) -> None:
        nonlocal rests
        rests += 1
        await real_rest(self, rest)

    monkeypatch.setattr(ChunkWriter, "send_now", send_now)
    monkeypatch.setattr(ChunkWriter, "send_rest", send_rest)
    if max_write is not None:
        monkeypatch.setattr(connections, "_send_now", lambda stream, data: real_send(stream, data[:max_write]))
    out = Collected()
    async with http(ep) as h, await rpc(ep) as c:
        async with trio.open_nursery() as readers:
            async with gate(ep) as g:
                rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=12))
                readers.start_soon(read_sse, h, rid, out)
                await trio.testing.wait_all_tasks_blocked()
                await g.step(2)  # tokenize, prefill (its first token)
                for _ in range(8):
                    await trio.testing.wait_all_tasks_blocked()
                    await g.step(1)
        final = await get_result(h, rid)
    events, done = parse_sse(out.lines or [])
    assert out.status == 200 and done
    assert sse_text(events) == text_of(final)
    return began, rests


async def test_a_decode_stream_is_written_by_the_generating_task(
    start_engine: Any, tiny_model: Any, monkeypatch: Any
) -> None:
    began, rests = await _decode_stream(await start_engine(tiny_model), monkeypatch, max_write=None)
    assert began >= 8 and rests == 0


async def test_a_decode_stream_arrives_whole_when_every_write_takes_only_a_few_bytes(
    start_engine: Any, tiny_model: Any, monkeypatch: Any
) -> None:
    began, rests = await _decode_stream(await start_engine(tiny_model), monkeypatch, max_write=7)
    assert began >= 8 and rests == began
