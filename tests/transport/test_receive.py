"""transport/receive.py: the one exact-length read and reply reader, driven as the blocking client
drives them (run_blocking, no event loop)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import trio
import xxhash

from hydra_trio.transport import (
    PeerClosed,
    RecvInto,
    draining_recv_into,
    payload_buffer,
    read_reply_head,
    recv_bytes,
    recv_exactly,
    recv_exactly_hashing,
    run_blocking,
)
from hydra_trio.wire import ErrorCode, ProtocolError, encode_response
from hydra_trio.wire.protocol import encode_response_header


def _feed(data: bytes, step: int = 3) -> RecvInto:
    """A recv_into that hands out ``data`` a few bytes at a time, then EOF."""
    pos = 0

    async def recv_into(view: memoryview, n: int) -> int:
        nonlocal pos
        k = min(n, step, len(data) - pos)
        view[:k] = data[pos : pos + k]
        pos += k
        return k

    return recv_into


def test_a_reply_read_in_pieces() -> None:
    recv = _feed(encode_response(0, {"n_past": 3}, 7) + b"payload")
    head, meta = run_blocking(read_reply_head(recv))
    assert meta == {"n_past": 3} and head.payload_len == 7
    assert run_blocking(recv_bytes(recv, head.payload_len)) == b"payload"


def test_a_close_mid_read_says_how_far_it_got() -> None:
    with pytest.raises(PeerClosed) as info:
        run_blocking(recv_bytes(_feed(b"abcde"), 8))
    assert (info.value.got, info.value.n, info.value.cause) == (5, 8, None)


def _raw_reply(meta: bytes) -> bytes:
    return encode_response_header(0, len(meta), 0) + meta


@pytest.mark.parametrize(("meta", "code"), [(b"[1,2,3]", ErrorCode.BAD_JSON), (b'{"x":NaN}', ErrorCode.BAD_JSON)])
def test_reply_meta_is_a_strict_json_object(meta: bytes, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        run_blocking(read_reply_head(_feed(_raw_reply(meta))))
    assert info.value.code is code


def test_reply_meta_is_capped() -> None:
    with pytest.raises(ProtocolError) as info:
        run_blocking(read_reply_head(_feed(_raw_reply(b'{"x":1}')), max_meta_bytes=2))
    assert info.value.code is ErrorCode.TOO_LARGE


def test_a_large_receive_buffer_is_reused_once_nothing_holds_it() -> None:
    """Above 64 MiB a payload lands in an anonymous mapping an earlier payload used (a
    fresh page's first touch is the costly part of a large receive), but never while any
    array or view of that payload is alive, and never for a payload under half its size."""
    n = 70 << 20

    def mapping_of(buf: np.ndarray) -> object:
        return buf.base.obj  # np.frombuffer's memoryview of the mapping

    first = payload_buffer(n)
    first[:] = 1
    held = mapping_of(first)
    view = first[10:20]
    del first
    second = payload_buffer(n)  # the first payload's view still holds its mapping
    assert mapping_of(second) is not held
    del view
    gc.collect()
    third = payload_buffer(n - 1)
    assert mapping_of(third) is held and third.nbytes == n - 1
    assert mapping_of(payload_buffer(64 << 20)) is not held  # third holds it
    del third
    gc.collect()
    assert mapping_of(payload_buffer(200 << 20)) is not held  # too small for that payload


async def test_draining_recv_into_fills_a_large_read_and_its_hash() -> None:
    """Across many sends and more than one 8 MiB drain, the bytes land in order and the
    digest taken behind them is the whole payload's."""
    data = np.random.default_rng(7).integers(0, 256, 20 << 20, dtype=np.uint8).tobytes()
    a, b = trio.socket.socketpair()
    with a, b:
        async with trio.open_nursery() as nursery:
            async def send() -> None:
                view = memoryview(data)
                off = 0
                while off < len(view):
                    off += await a.send(view[off : off + 333_333])

            nursery.start_soon(send)
            buf = bytearray(len(data))
            digest = await recv_exactly_hashing(
                draining_recv_into(b), memoryview(buf), (0, len(buf)), idle_timeout_s=10
            )
    assert bytes(buf) == data
    assert digest == xxhash.xxh3_64_intdigest(data)


async def test_draining_recv_into_reports_a_close_and_a_silent_peer() -> None:
    a, b = trio.socket.socketpair()
    with b:
        with a:
            await a.send(b"abc")
        with pytest.raises(PeerClosed):
            await recv_exactly(draining_recv_into(b), memoryview(bytearray(10)))
    a, b = trio.socket.socketpair()
    with a, b, pytest.raises(trio.TooSlowError):
        await recv_exactly(draining_recv_into(b), memoryview(bytearray(10)), idle_timeout_s=0.05)


async def test_draining_recv_into_on_a_closed_socket_reads_no_other_descriptor() -> None:
    """After its socket closes, a draining receive made for it raises (EBADF) rather than
    reading whatever socket has reused the descriptor number since."""
    a, b = trio.socket.socketpair()
    recv_into = draining_recv_into(b)
    b.close()
    c, d = trio.socket.socketpair()  # likely given b's old number
    with c, d:
        await c.send(b"not yours")
        with pytest.raises(OSError):
            await recv_into(memoryview(bytearray(16)), 16)
        assert await d.recv(16) == b"not yours"  # still unread: nothing took it
    a.close()


@pytest.mark.parametrize(("got", "span"), [(0, (0, 1000)), (0, (17, 500)), (40, (17, 500)), (600, (17, 500)),
                                           (40, (0, 1000)), (600, (500, 500)), (0, (999, 1)), (5, (0, 0))])
def test_the_hash_is_the_spans_whatever_arrived_before_and_however_it_comes(got: int, span: tuple[int, int]) -> None:
    """The digest is of ``span`` alone, its bytes hashed once each and in order, whether
    some were already in the buffer (``got``) and however the reads split them (7 bytes at
    a time here, across the span's edges); no event loop needed (the blocking client)."""
    data = np.random.default_rng(3).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    buf = bytearray(len(data))
    buf[:got] = data[:got]
    digest = run_blocking(recv_exactly_hashing(_feed(data[got:], step=7), memoryview(buf), span, got=got))
    assert bytes(buf) == data
    start, length = span
    assert digest == xxhash.xxh3_64_intdigest(data[start : start + length])
