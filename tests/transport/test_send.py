"""transport/send.py: the draining send (a large reply's writes without a trio yield each)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from hydra_trio.transport import draining_recv_into, draining_send, recv_exactly


async def _send_and_receive(parts: list, chunk: int | None) -> bytes:
    n = sum(memoryview(p).nbytes for p in parts)
    a, b = trio.socket.socketpair()
    buf = bytearray(n)
    with a, b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: draining_send(a, parts, idle_timeout_s=10, chunk=chunk))
            await recv_exactly(draining_recv_into(b), memoryview(buf), idle_timeout_s=10)
    return bytes(buf)


@pytest.mark.parametrize("chunk", [None, 65_537])
async def test_every_part_arrives_whole_and_in_order(chunk: int | None) -> None:
    """Parts of every kind (bytes, an empty one, a numpy array of another item size, one
    past the 8 MiB between yields), each across many writes, arrive byte for byte."""
    rng = np.random.default_rng(11)
    big = rng.integers(0, 256, (20 << 20) + 3, dtype=np.uint8)
    floats = rng.standard_normal(1000).astype(np.float32)
    parts = [b"head", b"", floats, memoryview(big), bytearray(b"tail")]
    got = await _send_and_receive(parts, chunk)
    assert got == b"head" + floats.tobytes() + big.tobytes() + b"tail"


async def test_a_peer_that_takes_nothing_times_out() -> None:
    a, b = trio.socket.socketpair()
    with a, b, pytest.raises(trio.TooSlowError):
        await draining_send(a, [bytes(64 << 20)], idle_timeout_s=0.05)


async def test_a_peer_that_left_breaks_the_send() -> None:
    a, b = trio.socket.socketpair()
    b.close()
    with a, pytest.raises(trio.BrokenResourceError):
        await draining_send(a, [bytes(1 << 20)], idle_timeout_s=5)


async def test_a_closed_socket_writes_to_no_other_descriptor() -> None:
    """After its socket closes, the send raises (EBADF) rather than writing into whatever
    socket has reused the descriptor number since."""
    a, b = trio.socket.socketpair()
    a.close()
    c, d = trio.socket.socketpair()  # likely given a's old number
    with b, c, d:
        with pytest.raises(trio.BrokenResourceError):
            await draining_send(a, [b"not for you"], idle_timeout_s=5)
        await c.send(b"c")
        await d.send(b"d")
        assert await d.recv(64) == b"c"  # nothing else arrived, either way
        assert await c.recv(64) == b"d"


async def test_a_cancelled_send_stops() -> None:
    a, b = trio.socket.socketpair()
    with a, b, trio.move_on_after(0.05) as scope:
        await draining_send(a, [bytes(64 << 20)], idle_timeout_s=None)
    assert scope.cancelled_caught
