"""The HTTP send path: a chunk goes out in one write when the socket has room, and what does
not fit goes the waiting way (Hypercorn's), in order, with nothing lost or sent twice; a
peer that is gone is reported as closed either way."""

from __future__ import annotations

import socket
from typing import Any

import h11
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, RawData

from hydra_trio.http.plumbing import ChunkWriter, connections
from hydra_trio.http.plumbing.connections import _GatedTCPServer


class _Protocol:
    def __init__(self) -> None:
        self.events: list[Any] = []

    async def handle(self, event: Any) -> None:
        self.events.append(event)


def _server_on_socketpair(sndbuf: int) -> tuple[_GatedTCPServer, trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    ours, peer = trio.SocketStream(a), trio.SocketStream(b)
    server = _GatedTCPServer(None, Config(), None, None, ours)  # type: ignore[arg-type]
    server.protocol = _Protocol()  # type: ignore[assignment]
    return server, ours, peer


async def test_chunks_larger_than_the_socket_buffer_arrive_whole_and_in_order(monkeypatch: Any) -> None:
    server, ours, peer = _server_on_socketpair(4096)
    partial = 0
    real = connections._send_now

    def counting(stream: Any, data: bytes) -> int:
        nonlocal partial
        n = real(stream, data)
        partial += n < len(data)
        return n

    monkeypatch.setattr(connections, "_send_now", counting)
    chunks = [bytes([i]) * (1000 + 37 * i) for i in range(200)]  # ~1 MB, the buffer is 4 KiB
    got = bytearray()

    async def read_slowly() -> None:
        while len(got) < sum(map(len, chunks)):
            got.extend(await peer.receive_some(3000))
            await trio.lowlevel.checkpoint()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_slowly)
            for chunk in chunks:
                await server.protocol_send(RawData(data=chunk))
    assert bytes(got) == b"".join(chunks)
    assert partial > 0, "the socket never filled: the waiting path was not exercised"
    assert server.protocol.events == []  # type: ignore[attr-defined]
    await ours.aclose()
    await peer.aclose()


async def test_a_small_chunk_goes_out_without_waiting() -> None:
    server, ours, peer = _server_on_socketpair(1 << 16)
    with trio.CancelScope() as scope:
        scope.cancel()  # a send that waited at all (a checkpoint) would raise Cancelled here
        await server.protocol_send(RawData(data=b"data: {}\n\n"))
    with trio.fail_after(5):
        assert await peer.receive_some(100) == b"data: {}\n\n"
    await ours.aclose()
    await peer.aclose()


async def test_a_gone_peer_is_reported_closed() -> None:
    server, ours, peer = _server_on_socketpair(1 << 16)
    await peer.aclose()
    with trio.fail_after(5):
        await server.protocol_send(RawData(data=b"x" * 100))
    assert any(isinstance(e, Closed) for e in server.protocol.events)  # type: ignore[attr-defined]
    await ours.aclose()


async def test_a_chunk_begun_is_finished_even_when_its_sender_is_cancelled() -> None:
    """A cancellation that lands after part of a chunk went out must not cut the chunk (the
    stream would be corrupt for whatever follows on the connection)."""
    server, ours, peer = _server_on_socketpair(4096)
    chunk = b"".join(b"%06d" % i for i in range(100_000))  # 600 kB, the buffer is 4 KiB
    got = bytearray()

    async def read_all() -> None:
        while len(got) < len(chunk):
            got.extend(await peer.receive_some(1 << 16))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all)
            with trio.CancelScope() as scope:
                scope.cancel()  # already cancelled when the rest has to wait for room
                await server.protocol_send(RawData(data=chunk))
    assert bytes(got) == chunk
    await ours.aclose()
    await peer.aclose()


# ---- ChunkWriter: a streamed body's chunks written by its producer ------------------------------


async def test_a_chunk_writer_frames_as_h11_and_hands_back_what_did_not_fit() -> None:
    server, ours, peer = _server_on_socketpair(4096)
    writer = ChunkWriter(server)
    assert writer.send_now(b"abc") == b""
    with trio.fail_after(5):
        assert await peer.receive_some(100) == b"3\r\nabc\r\n"
    big = bytes(range(256)) * 400  # 100 KiB through a 4 KiB buffer
    rest = writer.send_now(big)
    assert rest, "the socket took the whole chunk: nothing was left to hand back"
    got = bytearray()

    async def read_all() -> None:
        frame_len = len(b"%x\r\n" % len(big)) + len(big) + 2
        while len(got) < frame_len:
            got.extend(await peer.receive_some(1 << 16))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all)
            assert rest is not None
            await writer.send_rest(rest)
    assert bytes(got) == b"%x\r\n" % len(big) + big + b"\r\n"
    await ours.aclose()
    await peer.aclose()


async def test_a_chunk_writer_writes_nothing_while_hypercorn_sends_or_the_socket_is_full() -> None:
    server, ours, peer = _server_on_socketpair(4096)
    writer = ChunkWriter(server)
    async with server.send_lock:
        assert writer.send_now(b"abc") is None
    while writer.send_now(b"x" * 1000) is not None:  # fill the buffer (none read)
        pass
    assert writer.send_now(b"abc") is None
    await ours.aclose()
    await peer.aclose()


def test_a_chunk_is_framed_byte_for_byte_as_h11_frames_it() -> None:
    h11_conn = h11.Connection(h11.SERVER)
    h11_conn.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    h11_conn.next_event()
    h11_conn.send(h11.Response(status_code=200, headers=[]))  # no length: a chunked body
    for size in (1, 9, 15, 16, 255, 256, 4095, 65536, 1 << 20):
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        assert connections.chunk(data) == h11_conn.send(h11.Data(data=data)), size
