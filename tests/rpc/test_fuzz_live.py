"""The live fuzz campaign (hydra_trio.testing.rpcfuzz) at a CI budget: about 2,000 mutated and
hypothesis-drawn frames on persistent connections against an in-process engine, every reply
read; PREFILLs and accepted DECODEs run for real. No crash, hang, desync or resurrected entry,
and the engine is healthy afterwards. The full figure: `python -m benchmarks.fuzz`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helpers import MESSAGES, frame, http, kv_meta, prefill, rpc
from hydra_trio.rpc.client import decode_call, prefill_call
from hydra_trio.testing.rpcfuzz import run_campaign
from hydra_trio.wire import Status

FRAMES = 2000


async def test_live_fuzz_campaign(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, log_level="WARNING")
    report = await run_campaign(ep.rpc_port, ep.http_port, frames=FRAMES, seed=1, time_limit_s=120, hang_s=30)
    summary = report.as_dict()
    assert report.frames == FRAMES, summary
    assert report.findings == 0, summary
    # The campaign reached the deep paths, not only the frame checks.
    assert report.outcomes["OK"] > 100, summary
    assert report.decodes_accepted > 20, summary
    assert report.by_source["hypothesis"] > 500 and report.by_source["mutation"] > 500, summary
    assert report.outcomes["closed"] > 0, summary  # bad magic was tried
    assert report.health["ok"], summary


# ---- what the full campaign found, pinned ----------------------------------------------------


@pytest.mark.parametrize("role", [{}, [], {"": 1}, ["user"], 3, None])
async def test_a_message_role_that_is_not_a_string_is_a_bad_request(
    start_engine: Any, tiny_model: Path, role: Any
) -> None:
    """100,000 frames found one INTERNAL: an object or array as a message role raised
    TypeError (unhashable) in the chat template's role check. It is a client error on every
    path: DECODE, PREFILL and HTTP chat."""
    ep = await start_engine(tiny_model)
    messages = [{"role": role, "content": "hi"}]
    async with await rpc(ep) as c:
        resp = await c.call(prefill_call(0, {"messages": messages}), check=False)
        assert resp.status == Status.BAD_REQUEST and resp.meta["error_code"] == "BAD_JSON", resp.meta
        resp = await c.call(decode_call(0, frame(messages)), check=False)
        assert resp.status == Status.BAD_REQUEST and resp.meta["error_code"] == "BAD_JSON", resp.meta
        assert (await c.call(decode_call(0, frame(MESSAGES)), check=False)).ok
    async with http(ep) as h:
        r = await h.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 400, r.text


async def test_kv_sent_with_no_kv_metadata_is_a_cap_mismatch(start_engine: Any, tiny_model: Path) -> None:
    """The campaign found an INTERNAL: a DECODE carrying KV bytes and no ``kv_metadata``
    reached the identity verdict with no claims to judge. KV nobody vouches for is refused as
    claiming nothing, and the engine goes on."""
    ep = await start_engine(tiny_model)
    async with await rpc(ep) as c:
        pre = await prefill(c, 0, MESSAGES)
        resp = await c.call(decode_call(1, frame(MESSAGES, pre.payload)), check=False)
        assert resp.status == Status.ERROR and resp.meta["error_code"] == "CAP_MISMATCH", resp.meta
        assert "missing" in resp.meta["reason"], resp.meta
        assert (await c.call(decode_call(1, frame(MESSAGES, pre.payload, kv_metadata=kv_meta(pre))), check=False)).ok
