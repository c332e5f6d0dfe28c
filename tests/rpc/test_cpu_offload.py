"""Multi-MB CPU work on a payload (hashing, JSON, blob parsing) runs off the trio thread, so a
large DECODE or PREFILL does not stall every other connection and stream."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from helpers import decode, rpc
from hydra_trio.concurrency import CPU_OFFLOAD_MIN_BYTES
from hydra_trio.rpc import ops
from hydra_trio.rpc.client import build_decode_frame, prefill_call
from hydra_trio.wire import Status

BIG_TEXT = "word " * (CPU_OFFLOAD_MIN_BYTES // 4)  # > 1 MiB of JSON


def record_threads(monkeypatch: pytest.MonkeyPatch, name: str) -> list[bool]:
    """Wrap ``ops.<name>``; each call appends whether it ran on the main (trio) thread."""
    on_main: list[bool] = []
    real = getattr(ops, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        on_main.append(threading.current_thread() is threading.main_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, name, wrapped)
    return on_main


async def test_large_decode_frame_is_parsed_and_hashed_off_the_trio_thread(
    start_engine: Callable[..., Any], tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ep = await start_engine(tiny_model)
    on_main = record_threads(monkeypatch, "parse_decode_frame")
    async with await rpc(ep) as c:
        small = build_decode_frame({"messages": [{"role": "user", "content": "hi"}], "n_predict": 1}, b"")
        assert (await decode(c, 0, small)).status == Status.OK
        big = build_decode_frame({"messages": [{"role": "user", "content": BIG_TEXT}], "n_predict": 1}, b"")
        assert len(big) > CPU_OFFLOAD_MIN_BYTES
        await decode(c, 1, big)  # its prompt is tokenized after the reply (and fails then)
    assert on_main == [True, False]  # the small frame inline, the large one in a thread


async def test_large_prefill_json_is_parsed_off_the_trio_thread(
    start_engine: Callable[..., Any], tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ep = await start_engine(tiny_model)
    on_main = record_threads(monkeypatch, "decode_json_object")
    async with await rpc(ep) as c:
        body = {"prompt": BIG_TEXT}
        assert len(json.dumps(body)) > CPU_OFFLOAD_MIN_BYTES
        resp = await c.call(prefill_call(0, body), check=False)
        assert resp.status != Status.OK  # too long for the context
    assert on_main == [False]
