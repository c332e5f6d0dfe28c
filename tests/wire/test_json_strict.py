"""One JSON rule (wire/jsontext.py) on every path that parses JSON: HTTP bodies, RPC op
payloads (CONFIGURE, PREFILL), DECODE frames and KV_PULL requests all refuse what is not
strict JSON (NaN, Infinity, a number past a float's range, a byte-order mark, non-UTF-8),
and the HTTP refusal is a well-formed OpenAI-style 400."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import assert_error, assert_server_healthy, http, rpc
from hydra_trio.rpc.client import Call
from hydra_trio.wire import (
    ErrorCode,
    Op,
    ProtocolError,
    Status,
    encode_v3_raw,
    jsontext,
    parse_decode_frame,
)
from hydra_trio.wire.jsontext import parse_json, parse_json_object, parse_json_sliced
from hydra_trio.wire.kvpull import parse_pull_request
from hydra_trio.wire.protocol import decode_json_object

# Each is what some JSON library would write, and none is JSON.
NOT_JSON = [
    b'{"temperature":NaN}',
    b'{"temperature":Infinity}',
    b'{"temperature":-Infinity}',
    b'{"temperature":1e999}',
    b'{"temperature":-1E400}',
    b'\xef\xbb\xbf{"temperature":1}',  # a UTF-8 byte-order mark
    '{"temperature":1}'.encode("utf-16"),
    b'{"x":"\xff"}',
]


def _refused(parse: Any, data: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse(data)
    assert info.value.code is ErrorCode.BAD_JSON, info.value
    return info.value


@pytest.mark.parametrize("data", NOT_JSON)
def test_one_rule_on_every_wire_path(data: bytes) -> None:
    _refused(lambda d: parse_json_object(d, "body"), data)
    _refused(lambda d: decode_json_object(d, "CONFIGURE"), data)  # RPC op payloads
    _refused(parse_decode_frame, encode_v3_raw(data, b""))  # a DECODE header
    _refused(parse_pull_request, data)  # KV_PULL
    # A DECODE prompt segment (any JSON value, not just an object).
    table = {"v": 3, "segments": [{"id": "prompt", "offset": 0, "len": len(data), "hash": ""}]}
    _refused(parse_decode_frame, encode_v3_raw(json.dumps(table).encode(), data))


@pytest.mark.parametrize(
    ("data", "value"),
    [
        (b'{"t":1.7976931348623157e308}', {"t": 1.7976931348623157e308}),
        (b'{"t":-0.0,"u":1e-400}', {"t": -0.0, "u": 0.0}),  # underflow is a finite 0
        (b'{"t":"NaN","i":' + b"9" * 400 + b"}", {"t": "NaN", "i": int("9" * 400)}),
        ('{"é":"\\ud83d\\ude00"}'.encode(), {"é": "\U0001F600"}),  # a surrogate pair is one character
    ],
)
def test_finite_json_is_kept(data: bytes, value: Any) -> None:
    assert parse_json_object(data, "body") == value
    assert parse_json(memoryview(data), "body") == value


def test_not_an_object() -> None:
    for data in (b"[]", b"1", b'"x"', b"null"):
        assert "expected a JSON object" in _refused(lambda d: parse_json_object(d, "body"), data).message
    assert decode_json_object(b"", "CONFIGURE") == {}  # an empty op payload is {}


def test_a_lone_surrogate_is_refused_and_a_pair_is_one_character() -> None:
    """A lone \\uD800-\\uDFFF escape is JSON but no Unicode text: it was a 500 wherever the
    text was encoded again (a reply, a schema's grammar; the dialect fuzz found 20 in 100,000
    cases). Refused on input, whole or in slices, as a key or a value; a pair is one character."""
    assert parse_json(b'{"a": "\\ud83d\\ude00"}', "body") == {"a": "\U0001F600"}
    assert parse_json(b'{"a": "\\\\ud800"}', "body") == {"a": "\\ud800"}  # an escaped backslash: text
    for data in (b'{"a": "\\ud800"}', b'{"\\udc00": 1}', b'{"a": [1, {"b": "x\\uDFFFy"}]}', b'["\\ud83d"]'):
        assert "lone UTF-16 surrogate" in _refused(lambda d: parse_json(d, "body"), data).message
    big = '{"pad": "' + "x" * (jsontext.SLICED_MIN_CHARS + 10) + '", "a": "\\udbff"}'
    with pytest.raises(ProtocolError, match="lone UTF-16 surrogate"):
        steps = parse_json_sliced(big, "body")
        while True:
            next(steps)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
async def test_http_refuses_with_a_json_400(start_engine: Any, tiny_model: Path, route: str) -> None:
    ep = await start_engine(tiny_model, log_level="WARNING")
    async with http(ep) as h:
        for data in NOT_JSON:
            r = await h.post(route, content=data, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (data, r.text)
            error = r.json()["error"]  # the reply itself is strict JSON
            assert error["type"] == "invalid_request_error" and "JSON body" in error["message"], error
        ok = await h.post("/tokenize", json={"content": "hi", "with_pieces": False})
        assert ok.status_code == 200
    await assert_server_healthy(ep)


async def test_rpc_refuses_as_bad_json(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, log_level="WARNING")
    async with await rpc(ep) as c:
        for op in (Op.CONFIGURE, Op.PREFILL):
            resp = await c.call(Call(op, b"0", [b'{"messages":[{"role":"user","co'
                                                b'ntent":"hi"}],"temperature":NaN}']), check=False)
            assert_error(resp, Status.ERROR, "BAD_JSON")
        assert (await c.info()).ok
    await assert_server_healthy(ep)


# ---- a large body parsed in slices (wire/jsontext.py parse_json_sliced, issue 50) ------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=12) | st.dictionaries(st.text(max_size=6), inner, max_size=8),
    max_leaves=120,
)


def _sliced(text: str) -> tuple[Any, int]:
    steps, n = parse_json_sliced(text, "body"), 0
    while True:
        try:
            next(steps)
            n += 1
        except StopIteration as done:
            return done.value, n


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    value=JSON_VALUES,
    indent=st.sampled_from([None, 0, 2]),
    cut=st.integers(0, 10_000),
    junk=st.sampled_from(["", "x", ",", "]", "}", "NaN", "\\"]),
)
def test_a_body_parsed_in_slices_is_what_json_reads(
    value: Any, indent: int | None, cut: int, junk: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same value for any JSON text, and a refusal exactly where json refuses: windows and
    slices made tiny so every path (a window's C parse, a run of members, the walk) is taken."""
    monkeypatch.setattr(jsontext, "SLICE_CHARS", 16)
    monkeypatch.setattr(jsontext, "_WINDOWS", (4, 16))
    text = json.dumps(value, indent=indent)
    assert _sliced(text)[0] == json.loads(text)
    broken = text[: cut % (len(text) + 1)] + junk
    try:
        expected = json.loads(broken, parse_constant=lambda c: 1 / 0)
    except (ValueError, ZeroDivisionError, RecursionError):
        with pytest.raises(ProtocolError):
            _sliced(broken)
    else:
        assert _sliced(broken)[0] == expected


def test_slices_are_bounded_and_keep_json_s_rules() -> None:
    tiny = json.dumps({"role": "user", "content": "a"})
    body = '{"messages": [' + ",".join([tiny] * 20_000) + "]}"
    value, n = _sliced(body)
    assert value == json.loads(body) and n >= len(body) // jsontext.SLICE_CHARS - 1
    deep = "[" * 5000 + "]" * 5000  # past MAX_BODY_DEPTH, as past json's own depth: a 400, not a crash
    with pytest.raises(ProtocolError, match=r"nested deeper|recursion"):
        _sliced(deep)
    with pytest.raises(ProtocolError, match="nested deeper"):  # walked, past any window
        _sliced('{"a": ' + "[" * 5000 + " " * 40_000 + "]" * 5000 + "}")
    for bad in ('{"a": NaN}', '[1e999]', '{"a" 1}', '[1,]', '\ufeff{}', '{"a": 1} {}'):
        with pytest.raises(ProtocolError):
            _sliced(bad)
    assert _sliced('{"a": 1, "a": 2}')[0] == {"a": 2}  # the last duplicate wins, as json's
