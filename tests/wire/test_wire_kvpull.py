"""The KV_PULL codec and kv_transfer_params (wire/kvpull.py): pure, no engine."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_trio.wire import ErrorCode, ProtocolError, xxh3_tag
from hydra_trio.wire.kvpull import (
    KV_PULL_MAX_REQUEST_BYTES,
    check_pulled,
    encode_pull_request,
    export_params,
    parse_handoff_params,
    parse_pull_request,
    wants_remote_decode,
)

EXPORT_ID = "C-y9_-WYNiDPz1P1JzpZwQ"
BLOB = b"\x02" + bytes(range(200))
IDENTITY = {
    "model_alias": "tiny",
    "tokenizer": "llama",
    "tokenizer_hash": "xxh3:0123456789abcdef",
    "model_name": "Hydra Synthetic Tiny",
    "model_quant": "F16",
    "model_capabilities": 0,
}


def _params(**hydra: Any) -> dict[str, Any]:
    p = export_params(
        host="10.0.0.7",
        port=9504,
        export_id=EXPORT_ID,
        n_past=42,
        kv_hash=xxh3_tag(BLOB),
        kv_bytes=len(BLOB),
        ttl_s=30.0,
        identity={**IDENTITY, "model_path": "/secret/path.gguf"},
    )
    p["hydra"].update(hydra)
    return p


def test_pull_request_round_trip() -> None:
    assert parse_pull_request(encode_pull_request(EXPORT_ID)) == (EXPORT_ID, False)
    assert parse_pull_request(encode_pull_request(EXPORT_ID, shm=True)) == (EXPORT_ID, True)


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"", ErrorCode.BAD_JSON),
        (b"{", ErrorCode.BAD_JSON),
        (b"\xff\xfe", ErrorCode.BAD_JSON),
        (b"[1]", ErrorCode.BAD_JSON),
        (b"{}", ErrorCode.BAD_FRAME),
        (b'{"export_id": 7}', ErrorCode.BAD_FRAME),
        (b'{"export_id": "short"}', ErrorCode.BAD_FRAME),
        (b'{"export_id": "../../etc/passwd/xxxxxxxx"}', ErrorCode.BAD_FRAME),
        (b"[" * 100_000, ErrorCode.TOO_LARGE),
        (b"[" * 4000 + b"]" * 4000, ErrorCode.TOO_LARGE),
    ],
)
def test_bad_pull_requests(payload: bytes, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_pull_request(payload)
    assert info.value.code == code


def test_deep_nesting_under_the_cap_is_bad_json() -> None:
    payload = b"[" * (KV_PULL_MAX_REQUEST_BYTES // 2) + b"]" * (KV_PULL_MAX_REQUEST_BYTES // 2)
    with pytest.raises(ProtocolError) as info:
        parse_pull_request(payload)
    assert info.value.code == ErrorCode.BAD_JSON


def test_export_params_shape_and_round_trip() -> None:
    p = _params()
    # vLLM's keys keep their meaning; the router copies the object as it is.
    assert p["do_remote_decode"] is False and p["do_remote_prefill"] is True
    assert (p["remote_host"], p["remote_port"]) == ("10.0.0.7", 9504)
    assert "model_path" not in p["hydra"]  # identity, not where the file lives
    parsed = parse_handoff_params(json.loads(json.dumps(p)))
    assert parsed is not None
    assert (parsed.host, parsed.port, parsed.export_id, parsed.n_past) == ("10.0.0.7", 9504, EXPORT_ID, 42)
    assert parsed.identity == IDENTITY


def test_params_that_name_no_export() -> None:
    router_prefill = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert wants_remote_decode(router_prefill)
    assert parse_handoff_params(router_prefill) is None
    assert parse_handoff_params(None) is None
    assert parse_handoff_params({"remote_block_ids": [1, 2], "remote_engine_id": "vllm"}) is None
    for not_prefill in (None, {}, {"do_remote_decode": "true"}, {"do_remote_decode": 1}, [True]):
        assert not wants_remote_decode(not_prefill)


@pytest.mark.parametrize(
    "change",
    [
        {"hydra": "x"},
        {"hydra": {"v": 2}},
        {"remote_host": ""},
        {"remote_host": None},
        {"remote_port": 0},
        {"remote_port": "9504"},
        {"hydra.export_id": "bad id!"},
        {"hydra.n_past": 0},
        {"hydra.n_past": True},
        {"hydra.kv_hash": ""},
        {"hydra.kv_hash": "md5:abc"},
        {"hydra.kv_bytes": -1},
    ],
)
def test_malformed_hydra_params(change: dict[str, Any]) -> None:
    p = _params()
    for key, value in change.items():
        if key.startswith("hydra."):
            p["hydra"][key.split(".", 1)[1]] = value
        else:
            p[key] = value
    with pytest.raises(ProtocolError) as info:
        parse_handoff_params(p)
    assert info.value.code == ErrorCode.BAD_FRAME


def _meta(**over: Any) -> dict[str, Any]:
    return {"export_id": EXPORT_ID, "n_past": 42, "kv_bytes": len(BLOB), "kv_hash": xxh3_tag(BLOB), **over}


def test_check_pulled_accepts_the_announced_bytes() -> None:
    params = parse_handoff_params(_params())
    assert params is not None
    check_pulled(params, _meta(), BLOB)


@pytest.mark.parametrize(
    ("meta", "payload", "code"),
    [
        (_meta(), BLOB[:-1] + b"\x00", ErrorCode.HASH_MISMATCH),
        (_meta(kv_hash="xxh3:0000000000000000"), BLOB, ErrorCode.HASH_MISMATCH),
        (_meta(), BLOB + b"\x00", ErrorCode.BAD_FRAME),
        (_meta(export_id="D-y9_-WYNiDPz1P1JzpZwQ"), BLOB, ErrorCode.BAD_FRAME),
        (_meta(n_past=41), BLOB, ErrorCode.BAD_FRAME),
    ],
)
def test_check_pulled_refuses(meta: dict[str, Any], payload: bytes, code: ErrorCode) -> None:
    params = parse_handoff_params(_params())
    assert params is not None
    with pytest.raises(ProtocolError) as info:
        check_pulled(params, meta, payload)
    assert info.value.code == code


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    base=st.sampled_from(["valid", "empty"]),
    where=st.sampled_from(["top", "hydra"]),
    key=st.sampled_from(
        ["remote_host", "remote_port", "hydra", "v", "export_id", "n_past", "kv_hash", "kv_bytes", "x"]
    ),
    value=_JSON,
)
def test_any_params_parse_or_refuse_cleanly(base: str, where: str, key: str, value: Any) -> None:
    """Whatever a client puts in kv_transfer_params: None, a HandoffParams, or a BAD_FRAME."""
    p: dict[str, Any] = _params() if base == "valid" else {"hydra": {}}
    target = p if where == "top" or not isinstance(p.get("hydra"), dict) else p["hydra"]
    target[key] = value
    try:
        parsed = parse_handoff_params(p)
    except ProtocolError as err:
        assert err.code == ErrorCode.BAD_FRAME
        return
    assert parsed is None or (parsed.port > 0 and parsed.n_past > 0 and parsed.kv_hash.startswith("xxh3:"))


_HOSTISH = st.text(alphabet=st.sampled_from(list("ab.-_:%0129\x00\n é")), max_size=80) | st.sampled_from(
    ["a..b", "a" * 64, ".", "a.", "-a", "::1", "fe80::1%eth0", "127.0.0.1", "1.2.3.4.5", "x" * 254]
)


@settings(max_examples=400, deadline=None)
@given(
    field=st.sampled_from(
        ["remote_host", "remote_port", "hydra.shm", "hydra.shm.probe", "hydra.shm.token", "hydra.kv_cache",
         "hydra.kv_bytes", "hydra.n_past", "hydra.export_id", "hydra.kv_hash", "hydra.v", "hydra.tokenizer"]
    ),
    value=_JSON | _HOSTISH,
)
def test_what_parses_can_be_resolved_and_opened(field: str, value: Any) -> None:
    """Issue 28, 1.7, field by field: whatever one field holds, parsing gives a HandoffParams
    or a BAD_FRAME, and what it accepts the resolver can encode (no UnicodeError for a
    label past 63 characters or an empty one) and the probe path can be opened (no NUL:
    ValueError). Those were 500s."""
    p = _params(shm={"probe": "/dev/shm/hydra-kv-0-1-0badcafe-probe", "token": "t"})
    *where, key = field.split(".")
    target: Any = p
    for k in where:
        target = target[k]
    target[key] = value
    try:
        parsed = parse_handoff_params(p)
    except ProtocolError as err:
        assert err.code == ErrorCode.BAD_FRAME
        return
    assert parsed is not None
    parsed.host.encode("idna")  # what socket.getaddrinfo does with a str host
    assert "\x00" not in parsed.host
    assert all(isinstance(v, str) and "\x00" not in v for v in parsed.shm.values())
    assert 1 <= parsed.port <= 65535


@pytest.mark.parametrize("host", ["a..b", "a" * 64, ".", "..", "a\nb", "a b", "é.example", "", "x" * 254])
def test_malformed_hosts_are_bad_frames(host: str) -> None:
    with pytest.raises(ProtocolError) as err:
        parse_handoff_params({**_params(), "remote_host": host})
    assert err.value.code == ErrorCode.BAD_FRAME


@pytest.mark.parametrize(
    "host", ["prefill-0", "prefill-0.pd.svc.cluster.local.", "10.0.0.7", "::1", "fe80::1%eth0", "a" * 63]
)
def test_well_formed_hosts_parse(host: str) -> None:
    parsed = parse_handoff_params({**_params(), "remote_host": host})
    assert parsed is not None and parsed.host == host
