"""writeturn.WriterTurn: the write turn of a streamed body between its reader and a direct
writer (chat/text completion streams and DECODE result streams share it)."""

from __future__ import annotations

from hydra_trio.concurrency import WriterTurn, Wrote


class _Socket:
    """A ChunkSink whose socket takes ``room`` bytes of each chunk (None: all of it; 0:
    nothing), recording what went out."""

    def __init__(self) -> None:
        self.room: int | None = None
        self.sent: list[bytes] = []
        self.rests: list[bytes] = []

    def send_now(self, data: bytes) -> bytes | None:
        n = len(data) if self.room is None else min(self.room, len(data))
        if n == 0:
            return None
        self.sent.append(data[:n])
        return data[n:]

    async def send_rest(self, rest: bytes) -> None:
        self.rests.append(rest)


def _attached() -> tuple[WriterTurn, _Socket]:
    turn, sock = WriterTurn(), _Socket()
    turn.attach(sock, lambda text: f"<{text}>".encode())
    return turn, sock


def test_a_stream_never_attached_never_hands_its_turn_over() -> None:
    turn = WriterTurn()
    turn.hand_over()
    assert not turn.direct
    assert turn.write("x") is Wrote.NOTHING


def test_the_direct_writer_writes_only_in_its_turn_and_keeps_it_while_chunks_go_out_whole() -> None:
    turn, sock = _attached()
    assert turn.write("a") is Wrote.NOTHING and sock.sent == []  # the reader's turn
    turn.hand_over()
    assert turn.write("a") is Wrote.ALL and turn.write("b") is Wrote.ALL
    assert sock.sent == [b"<a>", b"<b>"] and turn.direct
    turn.take_back()
    assert turn.write("c") is Wrote.NOTHING and sock.sent == [b"<a>", b"<b>"]


def test_a_chunk_the_socket_does_not_take_ends_the_turn() -> None:
    turn, sock = _attached()
    turn.hand_over()
    sock.room = 0
    assert turn.write("a") is Wrote.NOTHING and not turn.direct and turn.rest == b""
    sock.room = None
    assert turn.write("b") is Wrote.NOTHING  # the reader sends "a" first


async def test_a_chunk_taken_in_part_leaves_its_rest_to_the_reader_first() -> None:
    turn, sock = _attached()
    turn.hand_over()
    sock.room = 2
    assert turn.write("abc") is Wrote.PART and not turn.direct
    assert sock.sent == [b"<a"] and turn.rest == b"bc>"
    sock.room = None
    assert turn.write("d") is Wrote.NOTHING  # nothing may come before the rest
    await turn.send_rest()
    await turn.send_rest()  # sent once
    assert sock.rests == [b"bc>"] and turn.rest == b""
