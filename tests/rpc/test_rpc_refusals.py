"""Refusals on a live RPC server (spec §1 rules, §2, §3): every malformed or refused request
gets exactly one well-formed non-OK reply carrying ``error`` and ``error_code`` (or a closed
connection where the spec says so), the stream never desynchronises, and afterwards the
server answers a fresh INFO with no slot stuck busy."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from helpers import (
    ENGINE,
    MESSAGES,
    assert_error,
    assert_server_healthy,
    chat,
    expect_closed,
    http,
    reset_on_close,
    rpc,
    wait_until,
)
from hydra_trio.rpc.client import Call, RpcClient, RpcConnectionClosed
from hydra_trio.wire import (
    MAGIC,
    Checkpoint,
    ErrorCode,
    Op,
    ProtocolError,
    Status,
    encode_blob_head,
    parse_kv_blob,
)
from hydra_trio.wire.protocol import REQUEST_HEADER, encode_request_header

N_VOCAB = 512
PROMPT = {"messages": MESSAGES}


def header(op: int, *, key: bytes = b"", payload_len: int = 0, trace: bytes = b"", flags: int = 0) -> bytes:
    return (
        encode_request_header(op, key_len=len(key), payload_len=payload_len, trace_len=len(trace), flags=flags)
        + key
        + trace
    )


async def prefill_blob(ep: Any, slot: int = 0, request: dict[str, Any] = PROMPT) -> bytes:
    async with await rpc(ep) as c:
        return bytes((await c.prefill(slot, request)).payload)


def state_get_blob(prefill_payload: bytes, n_vocab: int = N_VOCAB) -> bytes:
    """A PREFILL payload without its trailing logits (= what STATE_GET returns)."""
    return prefill_payload[: len(prefill_payload) - 4 * n_vocab]


async def slot_blob(c: RpcClient, slot: int) -> bytes:
    return bytes((await c.state_get(slot)).payload)


@pytest.fixture
async def engine(start_engine: Callable[..., Any], tiny_model: Path) -> Any:
    """The shared fixture's engine, single-threaded (see helpers.ENGINE)."""
    return await start_engine(tiny_model, **ENGINE)


# ---- transport ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "magic",
    [b"\x00\x00", b"\x48\x59", b"GE"],  # zero, byte-swapped magic, an HTTP client ("GET ...")
    ids=["zero", "swapped", "http"],
)
async def test_bad_magic_closes_without_reply(engine: Any, magic: bytes) -> None:
    good = encode_request_header(Op.INFO, key_len=0, payload_len=0)
    assert good[:2] == struct.pack("<H", MAGIC) and magic != good[:2]
    async with await rpc(engine) as c:
        await c.send_raw(magic + good[2:])
        await expect_closed(c)
    await assert_server_healthy(engine)


@pytest.mark.parametrize("op", [0x00, 0x2F, 0x33, 0x48, 0x99, 0xFF])
async def test_unknown_op(engine: Any, op: int) -> None:
    async with await rpc(engine) as c:
        resp = await c.call(Call(op, b"0", [b"x" * 300]), check=False)
        assert_error(resp, Status.ERROR, "UNKNOWN_OP")
        # The payload was drained: the next request on the same connection is in step.
        assert (await c.info()).ok
    await assert_server_healthy(engine)


@pytest.mark.parametrize("op", [Op.EXPERT_MODE, Op.QUANT_SWAP, Op.PIPELINE_ATTACH])
async def test_unimplemented_ops(engine: Any, op: int) -> None:
    async with await rpc(engine) as c:
        for payload in ([], [b'{"mode":"x"}'], [b"\x00" * 1000]):
            resp = await c.call(Call(op, b"0", payload), check=False)
            assert_error(resp, Status.NOT_IMPLEMENTED, "NOT_IMPLEMENTED")
        assert (await c.info()).ok
    await assert_server_healthy(engine)


BAD_KEYS = [b"abc", b"-1", b"1.5", b" 1", b"1 ", b"0x1", b"+1", b"\xff", b"\xd9\xa3", b"1234567890", b"0" * 40]


@pytest.mark.parametrize("op", [Op.STATE_GET, Op.STATE_PUT, Op.STATE_META, Op.PREFILL, Op.CONFIGURE, Op.INFO])
async def test_bad_keys(engine: Any, op: int) -> None:
    payload = [json.dumps(PROMPT).encode()] if op in (Op.PREFILL, Op.CONFIGURE, Op.STATE_PUT) else []
    async with await rpc(engine) as c:
        for key in BAD_KEYS:
            resp = await c.call(Call(op, key, payload), check=False)
            assert_error(resp, Status.BAD_REQUEST, "BAD_KEY")
        if op not in (Op.INFO, Op.CONFIGURE):  # those two take an empty key as slot 0
            assert_error(await c.call(Call(op, b"", payload), check=False), Status.BAD_REQUEST, "BAD_KEY")
        assert (await c.info()).ok
    await assert_server_healthy(engine)


@pytest.mark.parametrize("op", [Op.STATE_GET, Op.STATE_PUT, Op.STATE_META, Op.PREFILL, Op.CONFIGURE, Op.INFO])
async def test_missing_slot(engine: Any, op: int) -> None:
    payload = [json.dumps(PROMPT).encode()] if op in (Op.PREFILL, Op.CONFIGURE, Op.STATE_PUT) else []
    async with await rpc(engine) as c:
        for key in (b"2", b"99", b"999999999"):
            resp = await c.call(Call(op, key, payload), check=False)
            assert_error(resp, Status.NOT_FOUND, "NO_SLOT")
        assert (await c.info()).ok
    await assert_server_healthy(engine)


@pytest.mark.parametrize("flags", [0x01, 0x80, 0xFF])
async def test_unsupported_flags(engine: Any, flags: int) -> None:
    async with await rpc(engine) as c:
        payload = json.dumps({"seed": 1}).encode()
        await c.send_raw(header(Op.CONFIGURE, key=b"0", payload_len=len(payload), flags=flags) + payload)
        resp = await c.read_response()
        assert resp.status == Status.BAD_REQUEST, resp.meta
        assert resp.meta["error_code"] and "flags" in resp.meta["error"]
        assert resp.payload == b""
        assert (await c.info()).ok  # payload drained, still in step
        assert (await c.configure(0, {})).meta["params_applied"] == {}  # nothing was applied
    await assert_server_healthy(engine)


async def test_trace_id_is_accepted(engine: Any) -> None:
    async with await rpc(engine) as c:
        resp = await c.call(Call(Op.INFO, b"", ()), trace="trace-1234" * 10)
        assert resp.ok
        await c.send_raw(header(Op.STATE_META, key=b"0", trace="é".encode() * 100))
        assert (await c.read_response()).ok


# ---- size caps ------------------------------------------------------------------------------

CAPS = {"max_json_bytes": 1024, "drain_limit_bytes": 4096, "max_kv_bytes": 2048}


@pytest.fixture
async def capped(start_engine: Callable[..., Any], tiny_model: Path) -> Any:
    return await start_engine(tiny_model, **ENGINE, **CAPS)


@pytest.mark.parametrize(
    ("op", "size"),
    [(Op.CONFIGURE, 1025), (Op.CONFIGURE, 4096), (Op.PREFILL, 2000), (Op.STATE_PUT, 2049), (Op.STATE_PUT, 4096)],
)
async def test_oversized_payload_is_drained(capped: Any, op: int, size: int) -> None:
    """Over the cap but within the drain limit: TOO_LARGE, payload drained, connection kept."""
    async with await rpc(capped) as c:
        payload = b" " * size
        await c.send_raw(header(op, key=b"0", payload_len=size) + payload)
        assert_error(await c.read_response(), Status.BAD_REQUEST, "TOO_LARGE")
        info = await c.info()  # same connection
        assert info.ok and info.meta["engine"] == "hydra-trio"
        assert (await c.prefill(0, PROMPT)).ok  # a payload under the cap is served
    await assert_server_healthy(capped)


@pytest.mark.parametrize(
    ("op", "size"),
    [(Op.CONFIGURE, 4097), (Op.PREFILL, 1 << 20), (Op.STATE_PUT, 1 << 40), (Op.INFO, 4097), (0x99, 1 << 63)],
)
async def test_oversized_payload_over_drain_limit_closes(capped: Any, op: int, size: int) -> None:
    """Over the drain limit: one reply, then the connection is closed (no payload is sent:
    the server must not wait for it)."""
    async with await rpc(capped) as c:
        await c.send_raw(header(op, key=b"0", payload_len=size))
        resp = await c.read_response()
        assert resp.status != Status.OK and resp.meta["error_code"] in ("TOO_LARGE", "UNKNOWN_OP")
        assert resp.meta["error"]
        await expect_closed(c)
    await assert_server_healthy(capped)


WRITE_FIRST = {"drain_limit_bytes": 64 << 10, "max_kv_bytes": 16 << 20}  # refusals drain to the KV cap


async def test_refused_kv_payload_reaches_a_client_that_writes_first(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """STATE_PUT/DECODE payloads far past --drain-limit-bytes (8 MiB, more than the socket
    buffers hold) into a missing or busy slot: the client writes all of it before reading,
    as every KV client does, and gets the refusal, on a connection still in step."""
    engine = await start_engine(tiny_model, **ENGINE, **WRITE_FIRST)
    blob = b"\x02" + b"\x00" * ((8 << 20) - 1)
    before = engine.state.payload_budget.discarded
    holder = engine.state.engine._core.slots.claim(0, "test:holder")
    try:
        async with await rpc(engine) as c:
            for op, key, status, code in (
                (Op.STATE_PUT, b"99", Status.NOT_FOUND, "NO_SLOT"),
                (Op.STATE_PUT, b"0", Status.BUSY, "SLOT_BUSY"),
                (Op.DECODE, b"99", Status.NOT_FOUND, "NO_SLOT"),
            ):
                resp = await c.call(Call(op, key, [blob]), check=False)
                assert_error(resp, status, code)
                assert (await c.info()).ok  # drained: in step
    finally:
        engine.state.engine._core.slots.release(holder)
    assert engine.state.payload_budget.discarded - before == 3 * len(blob)
    assert engine.state.payload_budget.used == 0
    await assert_server_healthy(engine)


OVER_BOTH = {"drain_limit_bytes": 8 << 20, "max_json_bytes": 1024, "max_kv_bytes": 2 << 20}


async def test_a_refusal_over_the_drain_limit_reaches_a_client_that_writes_first(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """A payload over both the op's cap and --drain-limit-bytes (24 MiB: more than the socket
    buffers hold), written whole before the client reads, as the coordinator does: the engine
    writes TOO_LARGE, then reads and discards what the client goes on sending (up to
    LINGER_FACTOR times the drain bound) before it closes, so the client finishes its write
    and reads the refusal instead of a reset. Then the connection closes."""
    engine = await start_engine(tiny_model, **ENGINE, **OVER_BOTH)
    payload = b"\x02" + b"\x00" * ((24 << 20) - 1)
    before = engine.state.payload_budget.discarded
    for op in (Op.PREFILL, Op.STATE_PUT, Op.DECODE, Op.INFO):
        async with await rpc(engine) as c:
            resp = await c.call(Call(op, b"0", [payload]), check=False)
            assert_error(resp, Status.BAD_REQUEST, "TOO_LARGE")
            await expect_closed(c)
    assert engine.state.payload_budget.discarded - before == 4 * len(payload)
    assert engine.state.payload_budget.used == 0
    await assert_server_healthy(engine)


async def test_a_payload_past_the_linger_bound_is_still_answered_and_closed(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """The reading after the refusal is bounded (LINGER_FACTOR x the drain bound): a client
    declaring and sending more is cut off there, and the engine stays healthy."""
    engine = await start_engine(tiny_model, **ENGINE, drain_limit_bytes=1 << 20, max_json_bytes=1024)
    before = engine.state.payload_budget.discarded
    async with await rpc(engine) as c:
        with trio.fail_after(30):
            try:
                await c.call(Call(Op.PREFILL, b"0", [b" " * (16 << 20)]), check=False)
            except (trio.BrokenResourceError, RpcConnectionClosed, ConnectionResetError):
                pass  # cut off mid-write: the reset the bound costs
    assert engine.state.payload_budget.discarded - before <= 4 << 20
    assert engine.state.payload_budget.used == 0
    await assert_server_healthy(engine)


async def test_refused_payload_from_a_slow_client_closes(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    """A drain obeys the upload floor: a client that stops sending mid-payload is answered
    and closed once --min-upload-bytes-per-s is missed after the grace, not held."""
    engine = await start_engine(
        tiny_model, **ENGINE, **WRITE_FIRST, min_upload_bytes_per_s=1 << 20, upload_grace_s=0.2
    )
    async with await rpc(engine) as c:
        await c.send_raw(header(Op.STATE_PUT, key=b"99", payload_len=4 << 20) + b"\x00" * 1000)
        resp = await c.read_response()  # the refusal, then the close
        assert_error(resp, Status.NOT_FOUND, "NO_SLOT")
        await expect_closed(c)
    assert engine.state.payload_budget.used == 0
    await assert_server_healthy(engine)


async def test_payload_within_caps_is_served(capped: Any) -> None:
    async with await rpc(capped) as c:
        body = {"seed": 5, "pad": "x" * 900}
        assert len(json.dumps(body)) <= 1024
        assert (await c.configure(0, body)).meta["params_applied"] == {"seed": 5}


# ---- JSON -----------------------------------------------------------------------------------

BAD_JSON = [b"{bad", b"[1, 2]", b"null", b"42", b'"s"', b"\xff\xfe", b"{'a': 1}", b"[" * 5000 + b"]" * 5000, b"{}{}"]


async def test_configure_malformed_json(engine: Any) -> None:
    async with await rpc(engine) as c:
        for raw in BAD_JSON:
            resp = await c.call(Call(Op.CONFIGURE, b"0", [raw]), check=False)
            assert_error(resp, Status.ERROR, "BAD_JSON")
        assert (await c.info()).ok
    await assert_server_healthy(engine)


# ---- KV blobs -------------------------------------------------------------------------------


def _truncations(blob: bytes) -> dict[str, bytes]:
    n_tok = parse_kv_blob(blob).n_tokens
    head_len = 9 + 4 * n_tok + 1
    return {
        "empty": b"",
        "5-bytes": blob[:5],
        "head-only-9": blob[:9],
        "mid-tokens": blob[: 9 + 4 * (n_tok // 2)],
        "no-flags-byte": blob[: head_len - 1],
        "no-state": blob[:head_len],
    }


def _bad_structure(blob: bytes) -> dict[str, bytes]:
    parsed = parse_kv_blob(blob)
    head_len = 9 + 4 * parsed.n_tokens + 1
    ck = Checkpoint(0, parsed.n_past - 1, parsed.n_past, memoryview(b"\x00" * 16), memoryview(b""))
    return {
        "version-0x01": b"\x01" + blob[1:],
        "version-0x04": b"\x04" + blob[1:],
        "version-0xff": b"\xff" + blob[1:],
        "unknown-flag-bit": blob[: head_len - 1] + b"\x02" + blob[head_len:],
        "n_tok-too-large": blob[:5] + struct.pack("<I", 0xFFFFFFFF) + blob[9:],
        "n_tok-overruns": blob[:5] + struct.pack("<I", len(blob)) + blob[9:],
        # More tokens than the context (2048) holds, all present: refused before the list is built.
        "n_tok-beyond-context": encode_blob_head(parsed.n_past, [1] * 2049) + blob[head_len:],
        # A recurrent-state checkpoint on a model that has none: refused clearly.
        "checkpoint-on-non-recurrent": encode_blob_head(parsed.n_past, parsed.tokens, ck) + blob[head_len:],
    }


def _restore_failures(blob: bytes) -> dict[str, bytes]:
    parsed = parse_kv_blob(blob)
    head_len = 9 + 4 * parsed.n_tokens + 1
    state = blob[head_len:]
    n = parsed.n_past
    return {
        "corrupt-state-magic": blob[:head_len] + b"\x00\x00\x00\x00" + state[4:],
        "corrupt-stream-count": blob[:head_len] + state[:8] + struct.pack("<I", 9) + state[12:],
        "truncated-state": blob[: head_len + len(state) // 2],
        "truncated-last-byte": blob[:-1],
        "trailing-junk": blob + b"\x00" * 7,
        "n_past-mismatch": blob[:1] + struct.pack("<I", n + 1) + blob[5:],
        "n_past-beyond-context": blob[:1] + struct.pack("<I", 5000) + blob[5:],
        "token-count-mismatch": encode_blob_head(n, parsed.tokens[:-1]) + state,
        "logits-wrong-length": blob + b"\x00" * (4 * (N_VOCAB - 1)),
    }


async def _assert_slot_untouched(c: RpcClient, slot: int, before: bytes) -> None:
    meta = (await c.state_meta(slot)).meta
    assert meta["is_processing"] is False and meta["is_transferring"] is False
    assert await slot_blob(c, slot) == before


@pytest.mark.parametrize("damage", ["truncated", "malformed"])
async def test_damaged_blob_is_bad_frame(engine: Any, damage: str) -> None:
    blob = state_get_blob(await prefill_blob(engine, 0))
    variants = _truncations(blob) if damage == "truncated" else _bad_structure(blob)
    async with await rpc(engine) as c:
        before = await slot_blob(c, 0)
        for name, bad in variants.items():
            resp = await c.call(Call(Op.STATE_PUT, b"0", [bad]), check=False)
            assert resp.status == Status.BAD_REQUEST and resp.meta.get("error_code") == "BAD_FRAME", (name, resp.meta)
            assert resp.meta["error"]
            await _assert_slot_untouched(c, 0, before)  # refused before the slot is touched
    await assert_server_healthy(engine)


RESTORE_FAILURES = [
    "corrupt-state-magic",
    "corrupt-stream-count",
    "truncated-state",
    "truncated-last-byte",
    "trailing-junk",
    "n_past-mismatch",
    "n_past-beyond-context",
    "token-count-mismatch",
    "logits-wrong-length",
]
@pytest.mark.parametrize("case", RESTORE_FAILURES)
async def test_refused_restore_error_code(engine: Any, case: str) -> None:
    blob = state_get_blob(await prefill_blob(engine, 0))
    async with await rpc(engine) as c:
        resp = await c.call(Call(Op.STATE_PUT, b"0", [_restore_failures(blob)[case]]), check=False)
    assert_error(resp, Status.ERROR, "RESTORE_FAILED")


@pytest.mark.parametrize("case", RESTORE_FAILURES)
async def test_refused_restore_leaves_slot_clean_and_usable(ctx_engine: Any, case: str) -> None:
    engine = ctx_engine  # greedy text that depends on the KV: "same text" means "same KV"
    async with http(engine) as h:
        # Greedy text for the prompt from a fresh prefill (no cached prefix anywhere).
        alone = await chat(h, max_tokens=24)
    prefill = await prefill_blob(engine, 0)
    blob = state_get_blob(prefill)
    bad = _restore_failures(blob)[case]
    async with await rpc(engine) as c:
        before = await slot_blob(c, 0)
        resp = await c.call(Call(Op.STATE_PUT, b"0", [bad]), check=False)
        assert resp.status == Status.ERROR and resp.meta["error"] and resp.meta["error_code"], resp.meta
        meta = (await c.state_meta(0)).meta
        assert meta["is_processing"] is False and meta["is_transferring"] is False
        # All-or-nothing: the slot holds what it held before, or it was cleared (spec §2.2).
        after = await slot_blob(c, 0)
        assert after == before or parse_kv_blob(after).n_past == 0
        assert meta["n_past"] == parse_kv_blob(after).n_past
        # Usable: the good blob restores into it...
        put = await c.state_put(0, prefill)
        assert put.meta["n_past"] == parse_kv_blob(blob).n_past
        assert await slot_blob(c, 0) == before
        await c.prefill(1, {"prompt": "x"})  # slot 1 must not hold the prompt any more
    # ...and a completion continues from it with the same greedy text.
    async with http(engine) as h:
        body = await chat(h, max_tokens=24)
    assert body["id_slot"] == 0
    # The PREFILL blob's logits came along: no prompt token is evaluated again.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == alone["usage"]["prompt_tokens"]
    assert body["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    await assert_server_healthy(engine)


@pytest.fixture
async def tiny_and_wide(start_engine: Callable[..., Any], tiny_model: Path, tiny_model_wide: Path) -> tuple[Any, Any]:
    return await start_engine(tiny_model, **ENGINE, slots=1), await start_engine(tiny_model_wide, **ENGINE, slots=1)


async def test_blob_from_other_model_shape_is_refused(tiny_and_wide: tuple[Any, Any]) -> None:
    """A PREFILL blob from a model with another n_vocab: its logits do not fit. The slot
    keeps valid contents and the engine goes on."""
    ep, wide = tiny_and_wide
    foreign = await prefill_blob(wide, 0)
    async with await rpc(ep) as c:
        await c.prefill(0, PROMPT)
        resp = await c.call(Call(Op.STATE_PUT, b"0", [foreign]), check=False)
        assert resp.status == Status.ERROR and resp.meta["error"] and resp.meta["error_code"], resp.meta
        meta = (await c.state_meta(0)).meta
        assert meta["is_processing"] is False
        after = parse_kv_blob(await slot_blob(c, 0))
        assert after.n_past == meta["n_past"]
        assert all(0 <= t < N_VOCAB for t in after.tokens)
        assert (await c.prefill(0, PROMPT)).ok
    await assert_server_healthy(ep)


async def test_blob_from_other_model_shape_error_code(tiny_and_wide: tuple[Any, Any]) -> None:
    ep, wide = tiny_and_wide
    foreign = await prefill_blob(wide, 0)
    async with await rpc(ep) as c:
        resp = await c.call(Call(Op.STATE_PUT, b"0", [foreign]), check=False)
    assert_error(resp, Status.ERROR, "RESTORE_FAILED")


async def test_state_get_blob_with_foreign_token_ids_is_refused(tiny_and_wide: tuple[Any, Any]) -> None:
    ep, wide = tiny_and_wide
    foreign = state_get_blob(await prefill_blob(wide, 0), n_vocab=600)  # tiny_model_wide's n_vocab
    assert max(parse_kv_blob(foreign).tokens) >= N_VOCAB  # "world" is one wide-only piece
    async with await rpc(wide) as c:
        assert bytes((await c.state_get(0)).payload) == foreign
    async with await rpc(ep) as c:
        resp = await c.call(Call(Op.STATE_PUT, b"0", [foreign]), check=False)
        assert_error(resp, Status.ERROR, "RESTORE_FAILED")
        assert (await c.state_meta(0)).meta["n_past"] == 0


# ---- disconnects ----------------------------------------------------------------------------


def _partial_requests(blob: bytes) -> dict[str, bytes]:
    full_put = header(Op.STATE_PUT, key=b"0", payload_len=len(blob)) + blob
    prefill = json.dumps(PROMPT).encode()
    return {
        "mid-header": encode_request_header(Op.INFO, key_len=0, payload_len=0)[:7],
        "mid-key": encode_request_header(Op.STATE_META, key_len=5, payload_len=0)[:16] + b"1",
        "mid-trace": encode_request_header(Op.INFO, key_len=0, payload_len=0, trace_len=40) + b"abc",
        "put-mid-payload": full_put[: len(full_put) - len(blob) // 2],
        "put-header-only": full_put[: REQUEST_HEADER.size + 1],
        "prefill-mid-payload": header(Op.PREFILL, key=b"0", payload_len=len(prefill)) + prefill[:10],
        "configure-mid-payload": header(Op.CONFIGURE, key=b"0", payload_len=100) + b'{"seed":',
        "unknown-op-mid-drain": header(0x99, key=b"0", payload_len=1000) + b"x" * 10,
    }


async def test_client_disconnect_mid_request(engine: Any) -> None:
    blob = await prefill_blob(engine, 0)
    async with await rpc(engine) as c:
        before = await slot_blob(c, 0)
    for name, raw in _partial_requests(blob).items():
        stream = await trio.open_tcp_stream("127.0.0.1", engine.rpc_port)
        await stream.send_all(raw)
        await stream.aclose()  # announce N bytes, send fewer, hang up
        await assert_server_healthy(engine)
        async with await rpc(engine) as c:
            assert await slot_blob(c, 0) == before, name
    async with await rpc(engine) as c:
        assert (await c.state_put(1, blob)).ok


@pytest.mark.parametrize("close", ["fin", "reset"])
async def test_client_disconnect_during_prefill(engine: Any, close: str) -> None:
    """A PREFILL whose caller hangs up (a FIN or a reset) right after sending is cancelled;
    nothing is stuck."""
    long = {"messages": [{"role": "user", "content": "the " * 1500}]}
    payload = json.dumps(long).encode()
    eng = engine.state.engine
    before = eng._core.prompt_tokens_processed
    for _ in range(3):
        stream = await trio.open_tcp_stream("127.0.0.1", engine.rpc_port)
        await stream.send_all(header(Op.PREFILL, key=b"0", payload_len=len(payload)) + payload)
        if close == "reset":
            reset_on_close(stream)
        await stream.aclose()

    def open_connections() -> float:
        return engine.state.metrics.registry.get_sample_value("hydra_rpc_connections") or 0.0

    await wait_until(lambda: open_connections() == 0)  # all three handled, not just the first
    await assert_server_healthy(engine)
    abandoned = eng._core.prompt_tokens_processed - before
    async with await rpc(engine) as c:
        resp = await c.prefill(0, long)
        assert resp.ok and resp.meta["n_past"] > 1000
    # Three abandoned prefills did not all run to the end.
    assert abandoned < 3 * resp.meta["n_past"], abandoned


@pytest.mark.parametrize("recurrent_only", [False, True])
def test_checkpoint_section_applies_to_recurrent_models_only(recurrent_only: bool) -> None:
    """A v3 checkpoint (or recurrent-only capture) passes on a recurrent/hybrid model when it
    lies inside the blob's positions and is the size of the model's recurrent state; anywhere
    else it is refused, saying why."""
    from hydra_trio.engine.kv import check_checkpoint
    from hydra_trio.wire import encode_kv_blob
    from hydra_trio.wire.kvblob import KV_BLOB_V3

    def blob(pos_min: int, pos_max: int, n_tok: int) -> Any:
        ck = Checkpoint(pos_min, pos_max, n_tok, memoryview(b"ck"), memoryview(b""), recurrent_only)
        return parse_kv_blob(encode_kv_blob(4, [1, 2, 3, 4], b"state", checkpoint=ck, version=KV_BLOB_V3))

    check_checkpoint(blob(0, 2, 3), checkpoint_size=2)
    with pytest.raises(ProtocolError, match="no recurrent state, so a checkpoint does not apply") as info:
        check_checkpoint(blob(0, 2, 3), checkpoint_size=None)
    assert info.value.code is ErrorCode.BAD_FRAME
    assert ("recurrent-only capture" in info.value.message) is recurrent_only
    for bad in ((0, 4, 3), (3, 1, 2), (-1, 2, 3), (0, 2, 9)):
        with pytest.raises(ProtocolError, match="outside the 4 the blob holds"):
            check_checkpoint(blob(*bad), checkpoint_size=2)
    with pytest.raises(ProtocolError, match="of 2 bytes; the resident model's recurrent state is 3") as info:
        check_checkpoint(blob(0, 2, 3), checkpoint_size=3)
    assert info.value.code is ErrorCode.BAD_FRAME
