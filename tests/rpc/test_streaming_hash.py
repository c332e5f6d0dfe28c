"""A large DECODE's kv segment is hashed as it arrives (off the trio thread), and the frame
check uses that digest instead of hashing the segment again; every verdict stays the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helpers import (
    decode,
    frame,
    get_result,
    http,
    kv_meta,
    prefill,
    rpc,
    text_of,
    v3_raw,
)
from hydra_trio.concurrency import CPU_OFFLOAD_MIN_BYTES
from hydra_trio.wire import Status, encode_decode_frame_simple, encode_decode_frame_v3, hashing
from hydra_trio.wire.frames import v3_head_len, v3_kv_span

KV = bytes(range(256)) * 40
LONG = [{"role": "user", "content": "the wide cache " * 60}]


def test_kv_span_of_a_v3_frame_from_its_first_bytes() -> None:
    raw = encode_decode_frame_v3({"model": "m"}, {"prompt": "hi"}, KV)
    head = raw[: v3_head_len(raw[:4])]
    start, length = v3_kv_span(head, len(raw))  # type: ignore[misc]
    assert raw[start : start + length] == KV
    assert v3_kv_span(head[:-1], len(raw)) is None  # not all of the header yet
    assert v3_kv_span(raw[:3], len(raw)) is None


@pytest.mark.parametrize(
    "raw",
    [
        encode_decode_frame_simple({"prompt": "hi"}, KV),  # simple frame: nothing to hash ahead
        encode_decode_frame_v3({}, {"prompt": "hi"}, KV, hash_segments=False),  # no kv tag
        encode_decode_frame_v3({}, {"prompt": "hi"}, b""),  # no kv
    ],
)
def test_no_kv_span_when_there_is_nothing_to_check(raw: bytes) -> None:
    assert v3_kv_span(raw[: v3_head_len(raw[:4])], len(raw)) is None


def test_no_kv_span_for_a_damaged_header() -> None:
    raw = bytearray(encode_decode_frame_v3({"model": "m"}, {"prompt": "hi"}, KV))
    raw[20] ^= 1  # inside the header JSON: its hash no longer matches
    assert v3_kv_span(bytes(raw[: v3_head_len(raw[:4])]), len(raw)) is None


async def test_a_large_decode_is_checked_with_the_digest_made_as_it_arrived(
    start_engine: Any, wide_kv_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ep = await start_engine(wide_kv_model, threads=1, slots=2)
    async with http(ep) as h, await rpc(ep) as c:
        pre = await prefill(c, 1, LONG)
        assert len(pre.payload) > CPU_OFFLOAD_MIN_BYTES
        good = frame(LONG, pre.payload, n_predict=4, kv_metadata=kv_meta(pre))
        hashed_sizes: list[int] = []
        real = hashing.xxh3_64

        def recording(data: Any) -> int:
            hashed_sizes.append(len(memoryview(data)))
            return real(data)

        monkeypatch.setattr(hashing, "xxh3_64", recording)  # the engine's hashing, from here
        resp = await decode(c, 0, good)
        assert resp.status == Status.OK, resp.meta
        assert len(pre.payload) not in hashed_sizes  # the kv segment was not hashed again
        assert text_of(await get_result(h, resp.meta["decode_request_id"]))
        monkeypatch.undo()
        # A kv segment whose bytes differ from its tag is still refused, before any slot work.
        header = {"kv_metadata": kv_meta(pre), "generation": {"n_predict": 4}}
        tag = hashing.xxh3_tag(pre.payload)
        bad = v3_raw(header, b"", bytes(pre.payload), kv_hash=hashing.xxh3_tag(b"other bytes"))
        resp = await decode(c, 0, bad)
        assert resp.status != Status.OK and resp.meta["error_code"] == "HASH_MISMATCH", resp.meta
        assert "declared " + hashing.xxh3_tag(b"other bytes") + ", got " + tag in resp.meta["error"]
        ok_again = await decode(c, 0, v3_raw(header, b"", bytes(pre.payload), kv_hash=tag))
        assert ok_again.status == Status.OK, ok_again.meta
