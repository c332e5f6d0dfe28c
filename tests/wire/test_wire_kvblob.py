"""The KV blob (spec §3): v2 round trips, truncation, mutation, and the refusals; the v3 and
legacy (ggsq) blobs the C++ engine sends, built its way."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hydra_trio.wire import (
    Checkpoint,
    ErrorCode,
    KvBlob,
    ProtocolError,
    encode_blob_head,
    encode_kv_blob,
    parse_kv_blob,
)
from hydra_trio.wire.kvblob import (
    FLAG_CHECKPOINT,
    FLAG_RECURRENT_ONLY,
    KV_BLOB_V3,
    LEGACY_MAGIC,
    encode_legacy_blob,
    split_trailing_logits,
)

FAST = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

i32 = st.integers(-(2**31), 2**31 - 1)
u32 = st.integers(0, 2**32 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)

checkpoints = st.builds(
    Checkpoint,
    pos_min=i32,
    pos_max=i32,
    n_tokens=i64,
    data=st.binary(max_size=64).map(memoryview),
    draft=st.binary(max_size=32).map(memoryview),
)


@st.composite
def blobs(draw: st.DrawFn) -> tuple[bytes, dict]:
    """A valid encoded blob plus what went into it."""
    parts = {
        "n_past": draw(u32),
        "tokens": draw(st.lists(i32, max_size=48)),
        "state": draw(st.binary(min_size=1, max_size=128)),
        "logits": draw(st.none() | st.binary(max_size=16).map(lambda b: b[: len(b) // 4 * 4])),
        "checkpoint": draw(st.none() | checkpoints),
    }
    return encode_kv_blob(**parts), parts


def reencode(blob: KvBlob) -> bytes:
    """The bytes a parsed blob stands for: parsing is lossless iff this equals the input."""
    if blob.version == 0:
        return encode_legacy_blob(blob.tokens, blob.state)
    return encode_kv_blob(blob.n_past, blob.tokens, blob.state, checkpoint=blob.checkpoint, version=blob.version)


def assert_consistent(raw: bytes, blob: KvBlob) -> None:
    assert 0 <= blob.n_past < 2**32
    assert blob.n_tokens == len(blob.tokens)
    assert len(blob.state) > 0
    assert reencode(blob) == raw


@FAST
@given(case=blobs())
def test_round_trip_byte_exact(case: tuple[bytes, dict]) -> None:
    raw, parts = case
    blob = parse_kv_blob(raw)
    assert blob.n_past == parts["n_past"]
    assert blob.tokens == parts["tokens"]
    # The state view holds the llama state and, after PREFILL, the logits: only llama.cpp
    # knows where its state ends.
    assert bytes(blob.state) == parts["state"] + (parts["logits"] or b"")
    ck = parts["checkpoint"]
    if ck is None:
        assert blob.checkpoint is None
        assert raw[9 + 4 * len(parts["tokens"])] == 0  # flags byte
    else:
        assert blob.checkpoint is not None
        got = blob.checkpoint
        assert (got.pos_min, got.pos_max, got.n_tokens) == (ck.pos_min, ck.pos_max, ck.n_tokens)
        assert bytes(got.data) == bytes(ck.data)
        assert bytes(got.draft) == bytes(ck.draft)
    assert_consistent(raw, blob)
    # The head + state + logits streaming form is the same bytes.
    head = encode_blob_head(parts["n_past"], parts["tokens"], parts["checkpoint"])
    assert head + parts["state"] + (parts["logits"] or b"") == raw


@FAST
@given(case=blobs())
def test_parse_is_zero_copy(case: tuple[bytes, dict]) -> None:
    raw, _ = case
    buf = bytearray(raw)
    blob = parse_kv_blob(memoryview(buf))
    assert blob.state.obj is buf
    buf[-1] ^= 0xFF  # the view sees the caller's buffer, not a copy
    assert blob.state[-1] == buf[-1]


@FAST
@given(case=blobs(), data=st.data())
def test_every_truncation_refused_or_consistent(
    case: tuple[bytes, dict], data: st.DataObject
) -> None:
    raw, _ = case
    cut = data.draw(st.integers(0, len(raw) - 1))
    prefix = raw[:cut]
    try:
        blob = parse_kv_blob(prefix)
    except ProtocolError as exc:
        assert exc.code is ErrorCode.BAD_FRAME
    else:
        # Only a cut inside the state/logits can still parse: everything before is unchanged.
        assert_consistent(prefix, blob)
        full = parse_kv_blob(raw)
        assert blob.tokens == full.tokens
        assert bytes(full.state).startswith(bytes(blob.state))


def test_all_prefixes_of_one_checkpoint_blob() -> None:
    ck = Checkpoint(1, 9, 9, memoryview(b"ckpt-data"), memoryview(b"draft"))
    raw = encode_kv_blob(12, [5, -1, 7], b"STATE", b"\0" * 8, ck)
    head_len = len(raw) - len(b"STATE") - 8
    for cut in range(len(raw)):
        if cut <= head_len:
            with pytest.raises(ProtocolError) as info:
                parse_kv_blob(raw[:cut])
            assert info.value.code is ErrorCode.BAD_FRAME
        else:
            assert_consistent(raw[:cut], parse_kv_blob(raw[:cut]))


@st.composite
def mutated_blobs(draw: st.DrawFn) -> bytes:
    raw = bytearray(draw(blobs())[0])
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete"]))
        pos = draw(st.integers(0, len(raw) - 1)) if raw else 0
        if kind == "flip" and raw:
            raw[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and raw:
            raw[pos] = draw(st.integers(0, 255))
        elif kind == "insert":
            raw[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif raw:
            del raw[pos : pos + draw(st.integers(1, 8))]
    return bytes(raw)


def _refused_or_consistent(raw: bytes) -> None:
    try:
        blob = parse_kv_blob(raw)
    except ProtocolError as exc:
        assert exc.code is ErrorCode.BAD_FRAME
    else:
        assert_consistent(raw, blob)


@FAST
@given(raw=mutated_blobs())
def test_mutated_blob_refused_or_consistent(raw: bytes) -> None:
    _refused_or_consistent(raw)


@FAST
@given(raw=st.binary(max_size=96))
def test_arbitrary_bytes_refused_or_consistent(raw: bytes) -> None:
    _refused_or_consistent(raw)


@FAST
@given(raw=st.tuples(st.sampled_from([b"\x02"]), st.binary(max_size=64)).map(lambda t: t[0] + t[1]))
def test_arbitrary_v2_bodies_refused_or_consistent(raw: bytes) -> None:
    _refused_or_consistent(raw)


# --- specific refusals -------------------------------------------------------------------------


def _refused(raw: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_kv_blob(raw)
    assert info.value.code is ErrorCode.BAD_FRAME
    assert needle in info.value.message


GOOD = encode_kv_blob(3, [1, 2, 3], b"state")


@pytest.mark.parametrize("version", [0x00, 0x01, 0x04, 0x71, 0xFF])
def test_wrong_version(version: int) -> None:
    _refused(bytes([version]) + GOOD[1:], "version")


# --- the C++ engine's blobs ---------------------------------------------------------------------


def _fork_v3(n_past: int, tokens: list[int], state: bytes, ck: tuple[int, int, int, bytes, bytes] | None,
             recurrent_only: bool) -> bytes:
    """A v3 blob laid out field by field as the C++ engine writes it (spec §3, version byte
    0x03; flag bit 1 marks a recurrent-only checkpoint capture), independent of our encoder."""
    out = struct.pack("<BII", 0x03, n_past, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens)
    if ck is None:
        return out + b"\x00" + state
    pos_min, pos_max, n_tok, data, draft = ck
    out += bytes([0x01 | (0x02 if recurrent_only else 0)])
    out += struct.pack("<iiqQ", pos_min, pos_max, n_tok, len(data)) + data + struct.pack("<Q", len(draft)) + draft
    return out + state


def test_v3_without_checkpoint_is_v2_but_the_version_byte() -> None:
    v2 = encode_kv_blob(3, [1, 2, 3], b"state")
    v3 = _fork_v3(3, [1, 2, 3], b"state", None, False)
    assert v3[1:] == v2[1:] and v3[0] == KV_BLOB_V3
    a, b = parse_kv_blob(v2), parse_kv_blob(v3)
    assert (a.n_past, a.tokens, bytes(a.state)) == (b.n_past, b.tokens, bytes(b.state))
    assert (a.version, b.version) == (0x02, 0x03)
    assert encode_kv_blob(3, [1, 2, 3], b"state", version=KV_BLOB_V3) == v3


@pytest.mark.parametrize("recurrent_only", [False, True])
def test_v3_checkpoint_sections(recurrent_only: bool) -> None:
    raw = _fork_v3(4, [5, 6, 7, 8], b"kvkv", (0, 2, 3, b"ckpt", b"dr"), recurrent_only)
    blob = parse_kv_blob(raw)
    ck = blob.checkpoint
    assert ck is not None and ck.recurrent_only is recurrent_only
    assert (ck.pos_min, ck.pos_max, ck.n_tokens, bytes(ck.data), bytes(ck.draft)) == (0, 2, 3, b"ckpt", b"dr")
    assert bytes(blob.state) == b"kvkv"
    assert encode_kv_blob(4, [5, 6, 7, 8], b"kvkv", checkpoint=ck, version=KV_BLOB_V3) == raw


def test_recurrent_only_flag_is_v3s_alone() -> None:
    raw = bytearray(_fork_v3(4, [5, 6, 7, 8], b"kvkv", (0, 2, 3, b"ckpt", b""), True))
    raw[0] = 0x02
    _refused(bytes(raw), "unknown flag bits 0x03 for version 0x02")
    lone = bytearray(_fork_v3(3, [1, 2, 3], b"state", None, False))
    lone[9 + 12] = FLAG_RECURRENT_ONLY
    _refused(bytes(lone), "without a checkpoint")


def test_legacy_blob_is_llama_cpps_sequence_file() -> None:
    """The unversioned blob: u32 'ggsq' magic at offset 0, u32 file version, u32 n_tok,
    tokens, state. Its first byte (0x71) can never be a version byte."""
    raw = struct.pack("<III", 0x67677371, 2, 3) + struct.pack("<3i", 9, 8, 7) + b"state"
    assert raw[:4] == b"qsgg" and LEGACY_MAGIC == 0x67677371
    blob = parse_kv_blob(raw)
    assert (blob.version, blob.n_past, blob.tokens, bytes(blob.state), blob.checkpoint) == (
        0,
        3,
        [9, 8, 7],
        b"state",
        None,
    )
    assert encode_legacy_blob([9, 8, 7], b"state") == raw


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (struct.pack("<III", 0x67677371, 7, 0) + b"s", "file version 7"),
        (struct.pack("<III", 0x67677371, 2, 50) + b"s", "declares 50 tokens"),
        (struct.pack("<III", 0x67677371, 2, 1) + b"\0\0\0\0", "no KV state"),
        (struct.pack("<II", 0x67677371, 2), "legacy blob too short"),
    ],
)
def test_legacy_refusals(raw: bytes, needle: str) -> None:
    _refused(raw, needle)


@pytest.mark.parametrize("raw", [b"", b"\x02", GOOD[:9]])
def test_too_short(raw: bytes) -> None:
    _refused(raw, "too short")


def test_token_count_overflows_the_blob() -> None:
    raw = struct.pack("<BII", 2, 3, 1000) + b"\0" * 40
    _refused(raw, "declares 1000 tokens")


def test_token_count_implausible() -> None:
    raw = struct.pack("<BII", 2, 0, 2**32 - 1) + b"\0" * 40
    _refused(raw, "a slot holds at most")


def test_token_count_bounded_by_the_callers_limit() -> None:
    """The engine passes its n_ctx: a blob declaring more tokens is refused, all bytes present."""
    raw = encode_kv_blob(4, [1, 2, 3, 4], b"state")
    assert parse_kv_blob(raw, max_tokens=4).tokens == [1, 2, 3, 4]
    with pytest.raises(ProtocolError) as info:
        parse_kv_blob(raw, max_tokens=3)
    assert info.value.code is ErrorCode.BAD_FRAME
    assert "declares 4 tokens; a slot holds at most 3" in info.value.message


@pytest.mark.parametrize("flags", [0x02, 0x03, 0x04, 0x80, 0xFF])
def test_unknown_flags(flags: int) -> None:
    raw = bytearray(GOOD)
    raw[9 + 12] = flags
    _refused(bytes(raw), "unknown flag bits")


def test_no_state_bytes() -> None:
    _refused(encode_blob_head(3, [1, 2, 3]), "no KV state")


def _ck_head(size: int) -> bytes:
    return (
        struct.pack("<BII", 2, 0, 0)
        + bytes([FLAG_CHECKPOINT])
        + struct.pack("<iiqQ", 0, 1, 2, size)
    )


def test_checkpoint_header_truncated() -> None:
    _refused(_ck_head(0)[:-3], "checkpoint header truncated")


@pytest.mark.parametrize("size", [5, 2**63, 2**64 - 1])
def test_checkpoint_size_overflows(size: int) -> None:
    _refused(_ck_head(size) + b"abcd", "checkpoint declares")


def test_checkpoint_draft_size_truncated() -> None:
    _refused(_ck_head(2) + b"ab" + b"\0\0\0", "draft size truncated")


@pytest.mark.parametrize("size", [1, 2**64 - 1])
def test_checkpoint_draft_overflows(size: int) -> None:
    _refused(_ck_head(0) + struct.pack("<Q", size), "draft declares")


# --- trailing logits ---------------------------------------------------------------------------


def test_split_trailing_logits() -> None:
    assert split_trailing_logits(memoryview(b""), 4) is None
    tail = memoryview(b"\0" * 16)
    assert split_trailing_logits(tail, 4) is tail
    for size in (4, 12, 20):
        with pytest.raises(ProtocolError) as info:
            split_trailing_logits(memoryview(b"\0" * size), 4)
        assert info.value.code is ErrorCode.RESTORE_FAILED
