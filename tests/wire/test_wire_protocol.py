"""RPC transport headers, slot keys, JSON payloads, errors, and the purity of hydra_trio.wire."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hydra_trio.wire import (
    MAGIC,
    BadMagic,
    ErrorCode,
    Op,
    ProtocolError,
    Status,
    encode_request,
    encode_response,
    parse_request_header,
    parse_response_header,
)
from hydra_trio.wire.errors import DEFAULT_STATUS
from hydra_trio.wire.protocol import (
    MAX_META_LEN,
    decode_json_object,
    encode_meta,
    encode_request_header,
    encode_response_header,
    error_response,
    parse_slot_key,
)

# Deterministic and quick: fixed seed, no example database.
FAST = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u64 = st.integers(0, 2**64 - 1)


# --- request header ---------------------------------------------------------------------------


def test_magic_bytes_on_the_wire() -> None:
    head = encode_request_header(Op.INFO, key_len=0, payload_len=0)
    assert head[:2] == b"\x59\x48"
    assert len(head) == 16
    assert MAGIC == 0x4859


@FAST
@given(op=u8, flags=u8, key_len=u16, payload_len=u64, trace_len=u16)
def test_request_header_round_trip(
    op: int, flags: int, key_len: int, payload_len: int, trace_len: int
) -> None:
    raw = encode_request_header(
        op, key_len=key_len, payload_len=payload_len, trace_len=trace_len, flags=flags
    )
    head = parse_request_header(raw)
    assert (head.op, head.flags, head.key_len, head.payload_len, head.trace_len) == (
        op,
        flags,
        key_len,
        payload_len,
        trace_len,
    )
    assert head.body_len == key_len + trace_len + payload_len
    again = encode_request_header(
        head.op,
        key_len=head.key_len,
        payload_len=head.payload_len,
        trace_len=head.trace_len,
        flags=head.flags,
    )
    assert again == raw


@FAST
@given(
    op=u8, key=st.binary(max_size=40), payload=st.binary(max_size=200), trace=st.binary(max_size=40)
)
def test_whole_request_layout(op: int, key: bytes, payload: bytes, trace: bytes) -> None:
    raw = encode_request(op, key, payload, trace)
    head = parse_request_header(raw[:16])
    body = raw[16:]
    assert len(body) == head.body_len
    # Body order is key, trace, payload (spec §1).
    assert body[: head.key_len] == key
    assert body[head.key_len : head.key_len + head.trace_len] == trace
    assert body[head.key_len + head.trace_len :] == payload


@FAST
@given(raw=st.binary(min_size=16, max_size=16))
def test_any_16_bytes_parse_or_bad_magic(raw: bytes) -> None:
    if raw[:2] != b"\x59\x48":
        with pytest.raises(BadMagic):
            parse_request_header(raw)
        return
    head = parse_request_header(memoryview(raw))
    # Consistent: the fields re-encode to the very same bytes (flags are kept for the server,
    # which refuses non-zero flags with BAD_REQUEST after draining, spec §1).
    assert (
        encode_request_header(
            head.op,
            key_len=head.key_len,
            payload_len=head.payload_len,
            trace_len=head.trace_len,
            flags=head.flags,
        )
        == raw
    )


@pytest.mark.parametrize("size", [*range(16), 17, 32])
def test_request_header_wrong_size_is_bad_frame(size: int) -> None:
    raw = (encode_request_header(Op.INFO, key_len=1, payload_len=2) * 3)[:size]
    with pytest.raises(ProtocolError) as info:
        parse_request_header(raw)
    assert info.value.code is ErrorCode.BAD_FRAME


def test_request_flags_are_reported_not_swallowed() -> None:
    head = parse_request_header(encode_request_header(Op.INFO, key_len=0, payload_len=0, flags=4))
    assert head.flags == 4


# --- response header --------------------------------------------------------------------------


@FAST
@given(status=u8, meta_len=st.integers(0, MAX_META_LEN), payload_len=u64)
def test_response_header_round_trip(status: int, meta_len: int, payload_len: int) -> None:
    raw = encode_response_header(status, meta_len, payload_len)
    assert len(raw) == 12
    assert raw[0] == status  # status is the first byte, meta_len the next three (u24 LE)
    assert int.from_bytes(raw[1:4], "little") == meta_len
    head = parse_response_header(raw)
    assert (head.status, head.meta_len, head.payload_len) == (status, meta_len, payload_len)
    assert encode_response_header(head.status, head.meta_len, head.payload_len) == raw


@FAST
@given(raw=st.binary(min_size=12, max_size=12))
def test_any_12_bytes_parse_as_response_header(raw: bytes) -> None:
    head = parse_response_header(bytearray(raw))
    assert encode_response_header(head.status, head.meta_len, head.payload_len) == raw


@pytest.mark.parametrize("size", [0, 1, 11, 13, 24])
def test_response_header_wrong_size_is_bad_frame(size: int) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_response_header(bytes(size))
    assert info.value.code is ErrorCode.BAD_FRAME


@pytest.mark.parametrize("meta_len", [-1, MAX_META_LEN + 1, 1 << 32])
def test_response_meta_len_must_fit_u24(meta_len: int) -> None:
    with pytest.raises(ValueError):
        encode_response_header(0, meta_len, 0)


@FAST
@given(
    status=st.sampled_from(list(Status)),
    meta=st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=20), max_size=5),
    payload_len=st.integers(0, 2**40),
)
def test_encode_response_round_trip(status: Status, meta: dict, payload_len: int) -> None:
    raw = encode_response(status, meta, payload_len)
    head = parse_response_header(raw[:12])
    assert head.status == status
    assert head.payload_len == payload_len
    assert head.meta_len == len(raw) - 12
    assert json.loads(raw[12:]) == meta
    assert encode_meta(meta) == raw[12:]


@pytest.mark.parametrize("code", list(ErrorCode))
def test_error_response_carries_error_and_code(code: ErrorCode) -> None:
    err = ProtocolError(code, "nope", extra={"decode_request_id": 7})
    raw = error_response(err)
    head = parse_response_header(raw[:12])
    assert head.status == DEFAULT_STATUS[code] != Status.OK
    meta = json.loads(raw[12:])
    assert meta == {"decode_request_id": 7, "error": "nope", "error_code": code.value}


def test_error_status_override() -> None:
    err = ProtocolError(ErrorCode.BAD_FRAME, "x", status=Status.ERROR)
    assert err.status is Status.ERROR
    assert err.meta()["error_code"] == "BAD_FRAME"


def test_every_code_has_a_default_status() -> None:
    assert set(DEFAULT_STATUS) == set(ErrorCode)
    assert Status.OK not in DEFAULT_STATUS.values()


# --- slot keys --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "slot"), [(b"0", 0), (b"7", 7), (b"012", 12), (b"999999999", 999999999)]
)
def test_slot_key_valid(key: bytes, slot: int) -> None:
    assert parse_slot_key(key) == slot


def test_empty_slot_key() -> None:
    assert parse_slot_key(b"", empty_means_zero=True) == 0
    with pytest.raises(ProtocolError) as info:
        parse_slot_key(b"")
    assert info.value.code is ErrorCode.BAD_KEY


@pytest.mark.parametrize(
    "key", [b"-1", b" 1", b"1 ", b"+1", b"1.0", b"abc", b"1234567890", b"\xd9\xa1"]
)
def test_slot_key_invalid(key: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_slot_key(key)
    assert info.value.code is ErrorCode.BAD_KEY


@FAST
@given(key=st.binary(max_size=12))
def test_any_slot_key_parses_or_bad_key(key: bytes) -> None:
    try:
        slot = parse_slot_key(key, empty_means_zero=True)
    except ProtocolError as exc:
        assert exc.code is ErrorCode.BAD_KEY
    else:
        assert slot >= 0
        assert not key or int(key.decode("ascii")) == slot


# --- JSON payloads ----------------------------------------------------------------------------


def test_json_object_payload() -> None:
    assert decode_json_object(b'{"n_predict": 3}', "configure") == {"n_predict": 3}
    assert decode_json_object(memoryview(b'{"a":[1]}'), "configure") == {"a": [1]}
    assert decode_json_object(b"", "configure") == {}


@pytest.mark.parametrize(
    "payload",
    [
        b"{",
        b"nope",
        b'{"a":1}x',
        b"\xff\xfe{}",
        b'{"a":"\xc3"}',
        b"[1,2]",
        b"3",
        b'"s"',
        b"null",
        b'{"a":' + b"1" * 5000 + b"}",  # Python's int-digits limit raises plain ValueError
        b"[" * 100_000,  # deep nesting raises RecursionError inside json
    ],
)
def test_json_object_payload_refused(payload: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_json_object(payload, "configure")
    assert info.value.code is ErrorCode.BAD_JSON


@FAST
@given(payload=st.binary(max_size=64))
def test_any_json_payload_parses_or_bad_json(payload: bytes) -> None:
    try:
        value = decode_json_object(payload, "x")
    except ProtocolError as exc:
        assert exc.code is ErrorCode.BAD_JSON
    else:
        assert isinstance(value, dict)


# --- purity -----------------------------------------------------------------------------------

_SRC = Path(__file__).resolve().parents[2] / "src"

_BLOCKED_IMPORT_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {src!r})

    EXPLICIT = {{"llama_cpp", "trio", "numpy"}}
    ALLOWED = {{"xxhash", "hydra_trio"}}

    class Blocker:
        # Refuses llama_cpp/trio/numpy by name, and anything that is neither stdlib nor allowed.
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top in EXPLICIT or (top not in sys.stdlib_module_names and top not in ALLOWED):
                raise ImportError(f"blocked import of {{name}}")
            return None

    sys.meta_path.insert(0, Blocker())
    for name in list(sys.modules):
        if name.partition(".")[0] in EXPLICIT:
            raise SystemExit(f"{{name}} was imported at startup")

    import hydra_trio.wire
    import hydra_trio.wire.frames
    import hydra_trio.wire.hashing
    import hydra_trio.wire.kvblob
    import hydra_trio.wire.protocol

    frame = hydra_trio.wire.encode_decode_frame_v3({{}}, {{"prompt": "hi"}}, b"")
    assert hydra_trio.wire.parse_decode_frame(frame).request == {{"prompt": "hi"}}
    leaked = sorted(n for n in sys.modules if n.partition(".")[0] in EXPLICIT)
    assert not leaked, leaked
    print("ok")
    """
)


def test_wire_imports_without_heavy_dependencies() -> None:
    script = _BLOCKED_IMPORT_SCRIPT.format(src=str(_SRC))
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_image_positions_go_out_unsigned_with_their_blocks_media_keys() -> None:
    """An image's positions (negative ids in the engine's token lists) are published as the
    unsigned 31-bit values they stand for, never negative (llm-d's indexer decodes
    ``token_ids`` as uint32), and each block holding some names them in ``extra_keys`` as
    vLLM names a block's multimodal inputs; a text-only chain carries no ``extra_keys``."""
    from hydra_trio.wire.kvevents import MEDIA_KEY, block_stored, decode_batch, encode_batch

    image_a = [-1 - (5 << 1 | 1), -1 - (9 << 1), -1 - (7 << 1)]
    image_b = [-1 - (6 << 1 | 1), -1 - (9 << 1), -1 - (7 << 1)]
    text = [11, 12, 13, 14, 15]
    ev_a = block_stored([1, 2], None, [*text[:1], *image_a, *text[1:]], 4)
    ev_b = block_stored([3, 4], None, [*text[:1], *image_b, *text[1:]], 4)
    assert ev_a["token_ids"] == [11, 11, 18, 14, 12, 13, 14, 15]
    assert all(0 <= t < 2**31 for t in ev_a["token_ids"])
    keys_a, keys_b = ev_a["extra_keys"], ev_b["extra_keys"]
    assert keys_a[1] is None and keys_a[0][0] == MEDIA_KEY
    assert keys_a[0] != keys_b[0]  # two images at the same place: two keys
    plain = block_stored([5], None, text[:4], 4)
    assert "extra_keys" not in plain
    for encoding in ("map", "array"):
        (_, [back, back_plain], _) = decode_batch(encode_batch(0.0, [ev_a, plain], encoding=encoding))
        assert back["token_ids"] == ev_a["token_ids"]
        assert [tuple(k) if k else None for k in back["extra_keys"]] == keys_a
        assert "extra_keys" not in back_plain
