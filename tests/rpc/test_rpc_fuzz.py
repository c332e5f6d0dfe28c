"""Mutated requests against a live engine: every one gets exactly one well-formed response
or a closed connection, and the engine stays healthy (spec §1 rules 1-4)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import trio

from helpers import assert_server_healthy
from hydra_trio.rpc.client import build_decode_frame, encode_request_header
from hydra_trio.wire import Op, Status, encode_request, parse_response_header
from hydra_trio.wire.protocol import RESPONSE_HEADER

OPS = [int(op) for op in Op] + [0x00, 0x2F, 0x48, 0xFF]


def _valid_requests(blob: bytes) -> list[bytes]:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    frame = build_decode_frame(chat, b"")
    return [
        encode_request(Op.INFO),
        encode_request(Op.STATE_META, b"0"),
        encode_request(Op.CONFIGURE, b"1", json.dumps({"n_predict": 3}).encode()),
        encode_request(Op.PREFILL, b"0", json.dumps(chat).encode()),
        encode_request(Op.STATE_PUT, b"1", blob),
        encode_request(Op.DECODE, b"1", frame),
    ]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(6)
    if kind == 0 and len(b) > 16:  # flip bytes in the body
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(16, len(b))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # another op, same body
        b[2] = rng.choice(OPS)
    elif kind == 2:  # flags
        b[3] = rng.randrange(1, 256)
    elif kind == 3:  # a lying payload_len (shorter: the tail becomes the next request)
        body = len(b) - 16
        b[6:14] = rng.randrange(0, max(body, 1)).to_bytes(8, "little")
    elif kind == 4:  # garbage key
        return bytes(encode_request_header(b[2], key_len=3, payload_len=0)) + bytes(
            rng.randrange(256) for _ in range(3)
        )
    else:  # bad magic
        b[0] ^= 0xFF
    return bytes(b)


async def _exchange(port: int, data: bytes) -> str:
    """Send, half-close, then read until the server closes: every reply must be well formed
    (a header, JSON meta with error fields when not OK, exactly the announced bytes), and
    the server must end the connection (after our EOF) rather than hang."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        try:
            await stream.send_all(data)
            await stream.send_eof()
        except trio.BrokenResourceError:  # it already closed on us (e.g. bad magic)
            pass
        buf = b""
        outcome = "closed"
        while True:
            try:
                with trio.fail_after(10):
                    chunk = await stream.receive_some(1 << 16)
            except trio.BrokenResourceError:  # closed with our bytes unread: a reset
                chunk = b""
            if not chunk:
                assert buf == b"", f"stray bytes before close: {buf[:40]!r}"
                return outcome
            buf += chunk
            while len(buf) >= RESPONSE_HEADER.size:
                head = parse_response_header(buf[: RESPONSE_HEADER.size])
                end = RESPONSE_HEADER.size + head.meta_len + head.payload_len
                if len(buf) < end:
                    break
                meta = json.loads(buf[RESPONSE_HEADER.size : RESPONSE_HEADER.size + head.meta_len])
                assert head.status in {int(s) for s in Status}
                if head.status != Status.OK:
                    assert isinstance(meta.get("error"), str) and isinstance(meta.get("error_code"), str), meta
                buf = buf[end:]
                outcome = "replied"


async def test_mutated_requests_never_desync_or_hurt_the_engine(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model)
    from hydra_trio.rpc.client import RpcClient

    async with await RpcClient.connect("127.0.0.1", ep.rpc_port) as c:
        blob = bytes((await c.prefill(0, {"prompt": "hello"})).payload)
    valid = _valid_requests(blob)
    rng = random.Random(1234)
    outcomes: dict[str, int] = {}
    for _ in range(300):
        data = _mutate(rng, rng.choice(valid))
        outcome = await _exchange(ep.rpc_port, data)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes.get("replied", 0) > 100 and outcomes.get("closed", 0) > 20, outcomes
    await assert_server_healthy(ep)
