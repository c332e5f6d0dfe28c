"""DECODE payload frames (spec §4.1, §4.2 order) and the xxh3 tags they carry."""

from __future__ import annotations

import copy
import json
import struct
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hydra_trio.wire import (
    Checkpoint,
    DecodeFrame,
    ErrorCode,
    ProtocolError,
    check_tag,
    encode_decode_frame_simple,
    encode_decode_frame_v3,
    encode_kv_blob,
    encode_v3_raw,
    merged_generation,
    parse_decode_frame,
    parse_tag,
    xxh3_64,
    xxh3_tag,
)
from hydra_trio.wire.hashing import format_tag

FAST = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# --- strategies ---------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)
identity = st.fixed_dictionaries(
    {
        "tokenizer": st.sampled_from(["gpt2/qwen2", "llama/llama-bpe", "spm"]),
        "model_name": st.text(max_size=16),
        "model_quant": st.sampled_from(["Q4_K_M", "F16", "Q8_0"]),
        "model_capabilities": st.integers(0, 2**32 - 1),
    }
)
sampling = st.dictionaries(
    st.sampled_from(["temperature", "temp", "top_p", "top_k", "min_p", "seed", "repeat_penalty"]),
    st.floats(0, 2) | st.integers(0, 100),
    max_size=4,
)
headers = st.fixed_dictionaries(
    {
        "model": st.text(max_size=16),
        "kv_metadata": identity.map(lambda d: {**d, "n_past": 17}),
        "model_metadata": identity,
        "generation": st.fixed_dictionaries(
            {
                "n_predict": st.integers(-1, 4096),
                "sampling": sampling,
                "stop": st.lists(st.text(max_size=6), max_size=3),
                "stream": st.booleans(),
            }
        ),
    },
    optional={"x_extra": json_values},
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=40)}
    ),
    max_size=4,
)
requests = st.fixed_dictionaries(
    {},
    optional={
        "messages": messages,
        "prompt": st.text(max_size=40),
        "n_predict": st.integers(0, 512),
        "temperature": st.floats(0, 2),
        "stop": st.lists(st.text(max_size=6), max_size=3),
        "x_extra": json_values,
    },
)
real_blobs = st.builds(
    lambda n, toks, state, ck: encode_kv_blob(n, toks, state, checkpoint=ck),
    st.integers(0, 2**32 - 1),
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=16),
    st.binary(min_size=1, max_size=64),
    st.none()
    | st.builds(
        Checkpoint,
        st.integers(0, 9),
        st.integers(0, 9),
        st.integers(0, 9),
        st.binary(max_size=8).map(memoryview),
        st.binary(max_size=8).map(memoryview),
    ),
)
kvs = st.binary(max_size=200) | real_blobs
containers = st.sampled_from([bytes, bytearray, memoryview])


@st.composite
def v3_frames(draw: st.DrawFn) -> bytes:
    return encode_decode_frame_v3(
        draw(headers),
        draw(st.none() | requests | messages),
        draw(kvs),
        hash_segments=draw(st.booleans()),
    )


@st.composite
def simple_frames(draw: st.DrawFn) -> bytes:
    header = draw(headers)
    prompt = draw(st.none() | requests | messages | st.text(max_size=30) | st.just("absent"))
    if prompt != "absent":
        header["prompt"] = prompt
    return encode_decode_frame_simple(header, draw(kvs))


any_frames = v3_frames() | simple_frames()


# --- helpers ------------------------------------------------------------------------------------


def assert_consistent(payload: bytes, frame: DecodeFrame) -> None:
    """What a successful parse must satisfy, whatever the input was."""
    assert isinstance(frame, DecodeFrame)
    assert isinstance(frame.header, dict)
    assert isinstance(frame.request, dict)
    assert isinstance(frame.kv, memoryview)
    (n,) = struct.unpack_from("<I", payload)
    if frame.kind == "v3":
        header_bytes = payload[12 : 12 + n]
        assert struct.unpack_from("<Q", payload, 4)[0] == xxh3_64(header_bytes)
        assert json.loads(header_bytes) == frame.header
        assert frame.header["v"] == 3
        assert type(frame.header["v"]) is int
        table = {s["id"]: s for s in frame.header.get("segments") or []}
        body = payload[12 + n :]
        assert sum(s["len"] for s in table.values()) == len(body)
        kv = table.get("kv")
        assert bytes(frame.kv) == (body[kv["offset"] : kv["offset"] + kv["len"]] if kv else b"")
        if frame.kv_hash is not None:
            assert frame.kv_hash == xxh3_tag(frame.kv)
    else:
        assert frame.kind == "simple"
        assert payload[4] == ord("{")
        assert json.loads(payload[4 : 4 + n]) == frame.header
        assert bytes(frame.kv) == payload[4 + n :]
        assert frame.kv_hash is None


def refused_or_consistent(payload: bytes) -> ProtocolError | None:
    try:
        frame = parse_decode_frame(payload)
    except ProtocolError as exc:
        assert exc.code in {
            ErrorCode.BAD_FRAME,
            ErrorCode.TOO_LARGE,
            ErrorCode.HASH_MISMATCH,
            ErrorCode.BAD_JSON,
        }
        return exc
    assert_consistent(payload, frame)
    return None


def refused(payload: bytes, code: ErrorCode, **caps: int) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_decode_frame(payload, **caps)
    assert info.value.code is code, info.value
    return info.value


def raw_v3(header: Any, body: bytes = b"", *, header_hash: int | None = None) -> bytes:
    """A v3 frame from a hand-made header (correct header hash unless told otherwise)."""
    data = header if isinstance(header, bytes) else json.dumps(header).encode()
    return encode_v3_raw(data, body, header_hash=header_hash)


def seg(sid: Any, offset: Any, length: Any, tag: Any = "") -> dict[str, Any]:
    return {"id": sid, "offset": offset, "len": length, "hash": tag}


def framed(prompt: bytes, kv: bytes, p_tag: Any = "", k_tag: Any = "", **extra: Any) -> bytes:
    table = [seg("prompt", 0, len(prompt), p_tag), seg("kv", len(prompt), len(kv), k_tag)]
    return raw_v3({"v": 3, **extra, "segments": table}, prompt + kv)


KV = encode_kv_blob(3, [1, 2, 3], b"kv-state")
PROMPT = b'{"messages":[{"role":"user","content":"hi"}]}'


# --- hashing ------------------------------------------------------------------------------------


def test_xxh3_is_seedless_xxh3_64() -> None:
    # Reference value of XXH3_64bits("") (seed 0).
    assert xxh3_64(b"") == 0x2D06800538D394C2
    assert xxh3_tag(b"") == "xxh3:2d06800538d394c2"


def test_xxh3_tag_is_zero_padded_lowercase() -> None:
    data = next(d for d in (str(i).encode() for i in range(100_000)) if xxh3_64(d) < 1 << 60)
    tag = xxh3_tag(data)
    assert tag.startswith("xxh3:0")
    assert len(tag) == 21
    assert tag == tag.lower()
    assert int(tag[5:], 16) == xxh3_64(data)


@FAST
@given(data=st.binary(max_size=64), lo=st.integers(0, 8))
def test_hash_accepts_buffers(data: bytes, lo: int) -> None:
    expected = xxh3_64(data[lo:])
    assert xxh3_64(bytearray(data)[lo:]) == expected
    assert xxh3_64(memoryview(data)[lo:]) == expected
    check_tag(memoryview(data)[lo:], xxh3_tag(data[lo:]), "x")


@FAST
@given(value=st.integers(0, 2**64 - 1))
def test_tag_round_trip(value: int) -> None:
    assert parse_tag(format_tag(value)) == value
    assert parse_tag(format_tag(value).upper().replace("XXH3:", "xxh3:")) == value


def test_check_tag() -> None:
    check_tag(b"abc", "", "x")
    check_tag(b"abc", None, "x")
    check_tag(b"abc", xxh3_tag(b"abc"), "x")
    with pytest.raises(ProtocolError) as info:
        check_tag(b"abd", xxh3_tag(b"abc"), "prompt")
    assert info.value.code is ErrorCode.HASH_MISMATCH
    assert "prompt" in info.value.message


@pytest.mark.parametrize(
    "tag",
    [
        "xxh3:",
        "xxh3:123",
        "xxh3:0123456789abcdef0",
        "xxh3:0123456789abcdeg",
        "xxh3:0123456789abcde ",
        "XXH3:0123456789abcdef",
        "md5:0123456789abcdef",
        "0123456789abcdef",
        12345,
        0,
        False,
        ["xxh3:0123456789abcdef"],
    ],
)
def test_malformed_tag_is_bad_frame(tag: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        check_tag(b"abc", tag, "kv")
    assert info.value.code is ErrorCode.BAD_FRAME


# --- round trips --------------------------------------------------------------------------------


@FAST
@given(
    header=headers,
    request=requests,
    kv=kvs,
    hash_segments=st.booleans(),
    container=containers,
)
def test_v3_round_trip(
    header: dict, request: dict, kv: bytes, hash_segments: bool, container: type
) -> None:
    raw = encode_decode_frame_v3(header, request, kv, hash_segments=hash_segments)
    buf = container(raw)
    frame = parse_decode_frame(buf)
    assert frame.kind == "v3"
    assert {k: v for k, v in frame.header.items() if k not in ("v", "segments")} == header
    assert frame.header["v"] == 3
    assert frame.request == request
    assert bytes(frame.kv) == kv
    assert frame.kv.obj is (raw if container is memoryview else buf)  # zero copy
    assert frame.kv_hash == (xxh3_tag(kv) if hash_segments and kv else None)
    again = encode_decode_frame_v3(
        frame.header, frame.request, frame.kv, hash_segments=hash_segments
    )
    assert again == raw
    assert_consistent(raw, frame)


@FAST
@given(header=headers, prompt=messages, kv=kvs)
def test_v3_messages_array_prompt(header: dict, prompt: list, kv: bytes) -> None:
    frame = parse_decode_frame(encode_decode_frame_v3(header, prompt, kv))
    assert frame.request == {"messages": prompt}


@pytest.mark.parametrize("request_", [None, b"", bytearray(), memoryview(b"")])
def test_v3_empty_prompt(request_: Any) -> None:
    frame = parse_decode_frame(encode_decode_frame_v3({"model": "m"}, request_, KV))
    assert frame.request == {}
    assert bytes(frame.kv) == KV


def test_v3_raw_prompt_bytes_and_empty_kv() -> None:
    raw = encode_decode_frame_v3({}, PROMPT, b"")
    frame = parse_decode_frame(raw)
    assert frame.request == json.loads(PROMPT)
    assert len(frame.kv) == 0
    assert frame.kv_hash is None
    assert raw.endswith(PROMPT)


def test_v3_encoder_owns_v_and_segments() -> None:
    header = {"v": 2, "model": "m", "segments": "junk"}
    before = copy.deepcopy(header)
    frame = parse_decode_frame(encode_decode_frame_v3(header, {"prompt": "x"}, KV))
    assert header == before  # not mutated
    assert frame.header["v"] == 3
    assert [s["id"] for s in frame.header["segments"]] == ["prompt", "kv"]
    assert frame.header["segments"][1]["hash"] == xxh3_tag(KV) == frame.kv_hash


def test_v3_without_segment_hashes() -> None:
    frame = parse_decode_frame(encode_decode_frame_v3({}, {"prompt": "x"}, KV, hash_segments=False))
    assert [s["hash"] for s in frame.header["segments"]] == ["", ""]
    assert frame.kv_hash is None


@FAST
@given(
    header=headers,
    prompt=st.none() | requests | messages | st.text(max_size=30) | st.just("absent"),
    kv=kvs,
    container=containers,
)
def test_simple_round_trip(header: dict, prompt: Any, kv: bytes, container: type) -> None:
    if prompt != "absent":
        header["prompt"] = prompt
    raw = encode_decode_frame_simple(header, kv)
    buf = container(raw)
    frame = parse_decode_frame(buf)
    assert frame.kind == "simple"
    assert frame.header == header
    if isinstance(prompt, dict):
        assert frame.request == prompt
    elif isinstance(prompt, list):
        assert frame.request == {"messages": prompt}
    elif prompt is None or prompt == "absent":
        assert frame.request == {}
    else:
        assert frame.request == {"prompt": prompt}
    assert bytes(frame.kv) == kv
    assert frame.kv.obj is (raw if container is memoryview else buf)
    assert frame.kv_hash is None
    assert encode_decode_frame_simple(frame.header, frame.kv) == raw
    assert_consistent(raw, frame)


def test_simple_frame_layout() -> None:
    raw = encode_decode_frame_simple({"prompt": "hi"}, KV)
    assert raw == struct.pack("<I", 15) + b'{"prompt":"hi"}' + KV


# --- telling the kinds apart --------------------------------------------------------------------


def _v3_with_first_hash_byte(byte: int) -> bytes:
    for i in range(100_000):
        raw = encode_decode_frame_v3({"model": f"m{i:05d}"}, {"prompt": "x"}, KV)
        if raw[4] == byte:
            return raw
    raise AssertionError("unreachable")


def test_v3_whose_hash_starts_with_brace_is_still_v3() -> None:
    raw = _v3_with_first_hash_byte(ord("{"))
    frame = parse_decode_frame(raw)
    assert frame.kind == "v3"
    assert frame.header["model"].startswith("m")


def test_damaged_v3_whose_hash_starts_with_brace_reads_as_simple() -> None:
    # Documented consequence of the spec's rule: indistinguishable from a (broken) simple frame.
    raw = bytearray(_v3_with_first_hash_byte(ord("{")))
    raw[raw.index(b'"m') + 2] ^= 0x01  # still valid JSON, but no longer the hashed header
    refused(bytes(raw), ErrorCode.BAD_JSON)


def test_damaged_v3_is_hash_mismatch() -> None:
    raw = bytearray(_v3_with_first_hash_byte(0x00))
    raw[raw.index(b'"m') + 2] ^= 0x01
    refused(bytes(raw), ErrorCode.HASH_MISMATCH)


# --- truncation and mutation --------------------------------------------------------------------


@FAST
@given(raw=any_frames, data=st.data())
def test_truncation_refused_or_consistent(raw: bytes, data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(raw) - 1))
    refused_or_consistent(raw[:cut])


def test_every_prefix_of_a_v3_frame_is_refused() -> None:
    raw = _v3_with_first_hash_byte(0x00)
    for cut in range(len(raw)):
        exc = refused_or_consistent(raw[:cut])
        assert exc is not None
        assert exc.code is ErrorCode.BAD_FRAME


def test_every_prefix_of_a_simple_frame() -> None:
    raw = encode_decode_frame_simple({"prompt": "hi"}, KV)
    json_end = len(raw) - len(KV)
    for cut in range(len(raw)):
        exc = refused_or_consistent(raw[:cut])
        # Cut inside the JSON: truncated. Cut inside the KV: a shorter blob, parse_kv_blob's job.
        assert (exc is not None) == (cut < json_end)
        if exc is not None:
            assert exc.code is ErrorCode.BAD_FRAME


@st.composite
def mutated(draw: st.DrawFn, frames: st.SearchStrategy[bytes]) -> bytes:
    raw = bytearray(draw(frames))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "xor", "insert", "delete"]))
        pos = draw(st.integers(0, max(len(raw) - 1, 0)))
        if kind in ("flip", "xor") and raw:
            raw[pos] ^= (
                (1 << draw(st.integers(0, 7))) if kind == "flip" else draw(st.integers(1, 255))
            )
        elif kind == "insert":
            raw[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif raw:
            del raw[pos : pos + draw(st.integers(1, 8))]
    return bytes(raw)


@FAST
@given(raw=mutated(any_frames))
def test_mutation_refused_or_consistent(raw: bytes) -> None:
    refused_or_consistent(raw)


@FAST
@given(raw=st.binary(max_size=128))
def test_arbitrary_bytes_refused_or_consistent(raw: bytes) -> None:
    refused_or_consistent(raw)


@FAST
@given(hdr_len=st.integers(0, 80), rest=st.binary(max_size=96))
def test_arbitrary_simple_looking_bytes(hdr_len: int, rest: bytes) -> None:
    refused_or_consistent(struct.pack("<I", hdr_len) + b"{" + rest)


fuzz_ids = st.sampled_from(["prompt", "kv", "other", "", 1, None, ["kv"]])
fuzz_ints = st.integers(-2, 40) | st.sampled_from(
    [len(PROMPT), len(KV), len(PROMPT) + len(KV), 0.0, 1.5, True, False, "3", None, 2**70]
)
fuzz_tags = st.sampled_from(
    ["", None, "xxh3:0000000000000000", "xxh3:zz", 7, "xxh3:2d06800538d394c2"]
)


@FAST
@given(
    version=st.sampled_from([3, 3, 3, 2, "3", 3.0, None]),
    table=st.none()
    | st.lists(st.builds(seg, fuzz_ids, fuzz_ints, fuzz_ints, fuzz_tags), max_size=3)
    | st.sampled_from([{}, "x", 3]),
    body=st.binary(max_size=40) | st.sampled_from([PROMPT, PROMPT + KV, b"[]", b"{}"]),
)
def test_fuzzed_segment_tables(version: Any, table: Any, body: bytes) -> None:
    header: dict[str, Any] = {"v": version}
    if table is not None:
        header["segments"] = table
    refused_or_consistent(raw_v3(header, body))


@FAST
@given(raw=v3_frames(), data=st.data())
def test_v3_mutation_by_region(raw: bytes, data: st.DataObject) -> None:
    frame = parse_decode_frame(raw)
    (hdr_len,) = struct.unpack_from("<I", raw)
    segments = {s["id"]: s for s in frame.header["segments"]}
    regions = {"header": (12, 12 + hdr_len)}
    for sid in ("prompt", "kv"):
        s = segments[sid]
        if s["len"] and s["hash"]:
            start = 12 + hdr_len + s["offset"]
            regions[sid] = (start, start + s["len"])
    name = data.draw(st.sampled_from(sorted(regions)))
    lo, hi = regions[name]
    pos = data.draw(st.integers(lo, hi - 1))
    bad = bytearray(raw)
    bad[pos] ^= data.draw(st.integers(1, 255))
    exc = refused_or_consistent(bytes(bad))
    assert exc is not None
    if raw[4] != ord("{"):  # otherwise read as a (broken) simple frame, see above
        assert exc.code is ErrorCode.HASH_MISMATCH


# --- refusals: frame and caps -------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"", b"\x00", b"\x00\x00\x00"])
def test_too_short(raw: bytes) -> None:
    refused(raw, ErrorCode.BAD_FRAME)


@pytest.mark.parametrize(
    "raw", [b"\x00\x00\x00\x00", b"\x05\x00\x00\x00abc", b"\x02\x00\x00\x00" + bytes(9)]
)
def test_neither_kind_and_truncated(raw: bytes) -> None:
    refused(raw, ErrorCode.BAD_FRAME)


def test_header_over_default_cap() -> None:
    raw = encode_decode_frame_v3({"pad": "x" * (32 * 1024)}, {}, KV)
    refused(raw, ErrorCode.TOO_LARGE)


def test_simple_frame_json_may_carry_a_long_prompt() -> None:
    """The simple frame's JSON carries the prompt: it is capped at header + prompt caps,
    not at the header cap alone."""
    long_prompt = "x" * (40 * 1024)
    frame = parse_decode_frame(encode_decode_frame_simple({"prompt": long_prompt}, KV))
    assert frame.kind == "simple" and frame.request == {"prompt": long_prompt}
    raw = encode_decode_frame_simple({"prompt": "x" * 200}, KV)
    refused(raw, ErrorCode.TOO_LARGE, max_header_bytes=50, max_prompt_bytes=100)
    assert parse_decode_frame(raw, max_header_bytes=50, max_prompt_bytes=200).kind == "simple"


def test_header_cap_is_checked_before_reading_it() -> None:
    # A lying length is TOO_LARGE before anything else is looked at.
    refused(struct.pack("<I", 2**32 - 1) + b"{", ErrorCode.TOO_LARGE)


def test_header_cap_boundary() -> None:
    raw = encode_decode_frame_v3({"model": "m"}, {}, KV)
    (hdr_len,) = struct.unpack_from("<I", raw)
    assert parse_decode_frame(raw, max_header_bytes=hdr_len).kind == "v3"
    refused(raw, ErrorCode.TOO_LARGE, max_header_bytes=hdr_len - 1)


def test_prompt_and_kv_caps() -> None:
    raw = encode_decode_frame_v3({}, PROMPT, KV)
    assert parse_decode_frame(raw, max_prompt_bytes=len(PROMPT), max_kv_bytes=len(KV))
    refused(raw, ErrorCode.TOO_LARGE, max_prompt_bytes=len(PROMPT) - 1)
    refused(raw, ErrorCode.TOO_LARGE, max_kv_bytes=len(KV) - 1)
    simple = encode_decode_frame_simple({"prompt": "x"}, KV)
    assert parse_decode_frame(simple, max_kv_bytes=len(KV)).kind == "simple"
    refused(simple, ErrorCode.TOO_LARGE, max_kv_bytes=len(KV) - 1)


def test_simple_frame_truncated_json() -> None:
    refused(struct.pack("<I", 100) + b'{"prompt":"x"}', ErrorCode.BAD_FRAME)


@pytest.mark.parametrize(
    ("table", "body"),
    [
        pytest.param([seg("prompt", 0, 2), seg("extra", 2, 0)], b"{}", id="unknown-id"),
        pytest.param([seg(None, 0, 2)], b"{}", id="no-id"),
        pytest.param([seg(1, 0, 2)], b"{}", id="int-id"),
        pytest.param([seg(["kv"], 0, 2)], b"{}", id="list-id"),
        pytest.param([seg("kv", 0, 1), seg("kv", 1, 1)], b"ab", id="duplicate"),
        pytest.param([seg("prompt", 0, 2), seg("kv", 3, 2)], b"{}xab", id="gap"),
        pytest.param([seg("prompt", 0, 2), seg("kv", 1, 2)], b"{}a", id="overlap"),
        pytest.param([seg("kv", 1, 2)], b"xab", id="not-from-zero"),
        pytest.param([seg("kv", 0, 2)], b"abc", id="sum-short"),
        pytest.param([seg("kv", 0, 4)], b"abc", id="sum-long"),
        pytest.param([seg("kv", 0, 2**64)], b"abc", id="huge-len"),
        pytest.param([seg("kv", -1, 2)], b"ab", id="negative-offset"),
        pytest.param([seg("kv", 0, -2)], b"", id="negative-len"),
        pytest.param([seg("kv", 0.0, 2)], b"ab", id="float-offset"),
        pytest.param([seg("kv", 0, 2.0)], b"ab", id="float-len"),
        pytest.param([seg("kv", 0, True)], b"a", id="bool-len"),
        pytest.param([seg("kv", 0, "2")], b"ab", id="string-len"),
        pytest.param([{"id": "kv", "offset": 0}], b"", id="missing-len"),
        pytest.param(["kv"], b"", id="entry-not-object"),
        pytest.param({"kv": seg("kv", 0, 2)}, b"ab", id="table-not-list"),
        pytest.param("kv", b"", id="table-string"),
        pytest.param(None, b"ab", id="no-table-but-body"),
        pytest.param([seg("kv", 0, 2, "xxh3:12")], b"ab", id="short-tag"),
        pytest.param([seg("kv", 0, 2, 12)], b"ab", id="int-tag"),
        pytest.param([seg("kv", 0, 2, "sha1:0123456789abcdef")], b"ab", id="other-algo"),
    ],
)
def test_bad_segment_table(table: Any, body: bytes) -> None:
    header: dict[str, Any] = {"v": 3}
    if table is not None:
        header["segments"] = table
    refused(raw_v3(header, body), ErrorCode.BAD_FRAME)


@pytest.mark.parametrize(
    "header",
    [
        {"v": 3, "segments": [{"id": "NEST", "offset": 0, "len": 0}]},
        {"v": 3, "segments": [{"id": "kv", "offset": "NEST", "len": 0}]},
        {"v": "NEST", "segments": []},
    ],
)
def test_deeply_nested_values_in_the_table(header: dict) -> None:
    # Whatever depth json still accepts here, describing the value must not hit the recursion
    # limit: every depth is a refusal, BAD_FRAME where json accepted it.
    codes = set()
    limit = sys.getrecursionlimit()
    for depth in range(limit - 300, limit + 1, 3):
        nest = "[" * depth + "]" * depth
        raw = raw_v3(json.dumps(header).replace('"NEST"', nest).encode())
        with pytest.raises(ProtocolError) as info:
            parse_decode_frame(raw)
        codes.add(info.value.code)
    assert codes == {ErrorCode.BAD_FRAME, ErrorCode.BAD_JSON}


@pytest.mark.parametrize("version", [2, 4, "3", 3.0, True, None, [3]])
def test_wrong_version(version: Any) -> None:
    refused(raw_v3({"v": version, "segments": []}), ErrorCode.BAD_FRAME)


def test_missing_version() -> None:
    refused(raw_v3({"segments": []}), ErrorCode.BAD_FRAME)


@pytest.mark.parametrize(
    ("table", "body"),
    [
        pytest.param(None, b"", id="no-table-no-body"),
        pytest.param([], b"", id="empty-table"),
        pytest.param([seg("kv", 0, len(KV))], KV, id="kv-only"),
        pytest.param([seg("prompt", 0, len(PROMPT))], PROMPT, id="prompt-only"),
        pytest.param([seg("kv", 0, 0), seg("prompt", 0, len(PROMPT))], PROMPT, id="empty-kv-at-0"),
        pytest.param(
            [seg("kv", 0, len(KV)), seg("prompt", len(KV), len(PROMPT))], KV + PROMPT, id="kv-first"
        ),
        pytest.param(
            [seg("prompt", 0, len(PROMPT), xxh3_tag(PROMPT).upper().replace("XXH3", "xxh3"))],
            PROMPT,
            id="upper-hex-tag",
        ),
        pytest.param([{"id": "kv", "offset": 0, "len": len(KV)}], KV, id="no-hash-key"),
        pytest.param([{**seg("kv", 0, len(KV)), "hash": None, "x": 1}], KV, id="null-hash"),
    ],
)
def test_accepted_segment_tables(table: Any, body: bytes) -> None:
    header: dict[str, Any] = {"v": 3}
    if table is not None:
        header["segments"] = table
    raw = raw_v3(header, body)
    frame = parse_decode_frame(raw)
    assert_consistent(raw, frame)
    assert frame.request == (json.loads(PROMPT) if PROMPT in body else {})
    assert bytes(frame.kv) == (KV if KV in body else b"")


# --- refusals: hashes ---------------------------------------------------------------------------


def test_header_hash_mismatch() -> None:
    raw = raw_v3({"v": 3, "segments": []}, header_hash=0)
    assert raw[4] != ord("{")
    refused(raw, ErrorCode.HASH_MISMATCH)


def test_prompt_hash_mismatch() -> None:
    err = refused(framed(PROMPT, KV, p_tag=xxh3_tag(b"other")), ErrorCode.HASH_MISMATCH)
    assert "prompt" in err.message


def test_kv_hash_mismatch() -> None:
    err = refused(framed(PROMPT, KV, k_tag=xxh3_tag(KV[:-1])), ErrorCode.HASH_MISMATCH)
    assert "kv" in err.message


def test_good_hashes_and_canonical_kv_hash() -> None:
    upper = "xxh3:" + xxh3_tag(KV)[5:].upper()
    frame = parse_decode_frame(framed(PROMPT, KV, p_tag=xxh3_tag(PROMPT), k_tag=upper))
    assert frame.kv_hash == xxh3_tag(KV)


def test_empty_segment_tag_is_checked_too() -> None:
    # A non-empty tag is a claim, checked even for an empty segment.
    assert parse_decode_frame(framed(b"", b"", p_tag=xxh3_tag(b""), k_tag=xxh3_tag(b""))).kv_hash
    refused(framed(b"", b"", k_tag="xxh3:0000000000000000"), ErrorCode.HASH_MISMATCH)


# --- refusals: JSON -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        b"",
        b"{",
        b'{"v":3,}',
        b"[3]",
        b'"v"',
        b"3",
        b"null",
        b'{"v":3,"x":"\xff"}',
        b'\xef\xbb\xbf{"v":3}',
        b'{"v":3,"t":NaN}',
        b'{"v":3,"t":-Infinity}',
        b'{"v":3,"n":' + b"1" * 5000 + b"}",
        b"[" * 20_000,
    ],
)
def test_bad_header_json(header: bytes) -> None:
    refused(raw_v3(header), ErrorCode.BAD_JSON)


@pytest.mark.parametrize(
    "prompt",
    [
        b"{",
        b"3",
        b'"hi"',
        b"null",
        b"true",
        b" ",
        b"\xff\xfe{}",
        b"NaN",
        b"[" * 100_000,
        b'{"a":1}{}',
    ],
)
def test_bad_prompt_json(prompt: bytes) -> None:
    refused(framed(prompt, KV), ErrorCode.BAD_JSON)


@pytest.mark.parametrize(
    "header", [b"{x", b'{"prompt":3}', b'{"prompt":true}', b'{"prompt":1.5}', b"{}}"]
)
def test_bad_simple_json(header: bytes) -> None:
    refused(struct.pack("<I", len(header)) + header + KV, ErrorCode.BAD_JSON)


# --- refusals: order (spec §4.2: frame and caps -> hashes -> JSON) -----------------------------


def test_order_header_hash_before_header_json() -> None:
    refused(raw_v3(b"[not json", header_hash=0), ErrorCode.HASH_MISMATCH)


def test_order_unverified_header_decides_nothing() -> None:
    # A bad segment table inside a header whose hash is wrong: the hash is what failed.
    refused(raw_v3({"v": 3, "segments": "junk"}, header_hash=0), ErrorCode.HASH_MISMATCH)


def test_order_segment_table_before_segment_hashes() -> None:
    table = [seg("prompt", 0, len(PROMPT), xxh3_tag(b"x")), seg("kv", 0, len(KV))]
    refused(raw_v3({"v": 3, "segments": table}, PROMPT + KV), ErrorCode.BAD_FRAME)
    refused(framed(PROMPT, KV, p_tag=xxh3_tag(b"x"), k_tag="xxh3:bad"), ErrorCode.BAD_FRAME)


def test_order_caps_before_segment_hashes() -> None:
    raw = framed(PROMPT, KV, k_tag=xxh3_tag(b"x"))
    refused(raw, ErrorCode.TOO_LARGE, max_kv_bytes=len(KV) - 1)


def test_order_prompt_hash_before_kv_hash() -> None:
    err = refused(framed(PROMPT, KV, xxh3_tag(b"x"), xxh3_tag(b"y")), ErrorCode.HASH_MISMATCH)
    assert "prompt" in err.message


def test_order_hashes_before_prompt_json() -> None:
    refused(framed(b"{broken", KV, p_tag=xxh3_tag(b"x")), ErrorCode.HASH_MISMATCH)
    refused(framed(b"{broken", KV, k_tag=xxh3_tag(b"x")), ErrorCode.HASH_MISMATCH)


def test_order_version_before_segments() -> None:
    refused(raw_v3({"v": 2, "segments": "junk"}), ErrorCode.BAD_FRAME)


# --- merged generation --------------------------------------------------------------------------


def _frame(generation: Any, request: Any, **header: Any) -> DecodeFrame:
    if generation is not None:
        header["generation"] = generation
    return parse_decode_frame(encode_decode_frame_v3(header, request, KV))


def test_merged_request_wins() -> None:
    gen = {
        "n_predict": 4,
        "temperature": 0.1,
        "sampling": {"temperature": 0.5, "top_k": 3},
        "stop": ["a"],
        "stream": True,
    }
    req = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.9, "stop": ["b"]}
    frame = _frame(gen, req)
    before = copy.deepcopy((frame.header, frame.request))
    assert merged_generation(frame) == {
        "n_predict": 4,
        "temperature": 0.9,
        "top_k": 3,
        "stop": ["b"],
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert (frame.header, frame.request) == before  # inputs untouched


def test_merged_sampling_beats_its_own_layer() -> None:
    frame = _frame({"temperature": 0.1, "sampling": {"temperature": 0.5}}, None)
    assert merged_generation(frame) == {"temperature": 0.5}


def test_merged_request_sampling_object_is_flattened() -> None:
    frame = _frame({"sampling": {"top_p": 0.9, "top_k": 5}}, {"sampling": {"top_p": 0.5}})
    assert merged_generation(frame) == {"top_p": 0.5, "top_k": 5}


def test_merged_aliases() -> None:
    frame = _frame({"sampling": {"temperature": 0.5, "penalty_repeat": 1.1}}, {"temp": 0.9})
    assert merged_generation(frame) == {"temperature": 0.9, "repeat_penalty": 1.1}
    # Both spellings in one layer: the canonical one is used.
    frame = _frame({"sampling": {"temp": 0.2, "temperature": 0.3}}, None)
    assert merged_generation(frame) == {"temperature": 0.3}


@pytest.mark.parametrize("generation", [None, "x", 3, ["n_predict"]])
def test_merged_non_object_generation_ignored(generation: Any) -> None:
    frame = _frame(generation, {"n_predict": 2})
    assert merged_generation(frame) == {"n_predict": 2}


def test_merged_non_object_sampling_left_for_the_consumer() -> None:
    frame = _frame({"sampling": 3, "n_predict": 1}, None)
    assert merged_generation(frame) == {"sampling": 3, "n_predict": 1}


def test_merged_simple_frame() -> None:
    raw = encode_decode_frame_simple(
        {"generation": {"n_predict": 8, "sampling": {"seed": 1}}, "prompt": "hello"}, KV
    )
    assert merged_generation(parse_decode_frame(raw)) == {
        "n_predict": 8,
        "seed": 1,
        "prompt": "hello",
    }


@FAST
@given(header=headers, request=requests)
def test_merged_request_keys_always_win(header: dict, request: dict) -> None:
    merged = merged_generation(parse_decode_frame(encode_decode_frame_v3(header, request, b"")))
    for key, value in request.items():
        assert merged[key] == value
    assert "sampling" not in merged
    assert "temp" not in merged
