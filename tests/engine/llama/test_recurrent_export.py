"""A recurrent model's KV leaves and enters engines of every KV layout (issue 50): on a split
cache of several slots its sequence state has no stream count to rewrite (its recurrent
section is one pool of per-sequence states), so PREFILL, STATE_GET, STATE_PUT, DECODE and the
P/D export work as on a unified one, and a hand-off continues as the engine that made it.
Each test runs on the mamba model (a recurrent state only) and the hybrid one (lfm2: a KV
cache, whose streams are rewritten, then a recurrent state, carried as it is)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from helpers import (
    ENGINE,
    assert_server_healthy,
    chat_text,
    decode_ok,
    frame,
    get_result,
    http,
    kv_meta,
    rpc,
    text_of,
)
from hydra_trio.rpc.client import prefill_call, state_get_call, state_meta_call, state_put_call
from hydra_trio.wire import parse_kv_blob

MESSAGES = [{"role": "user", "content": "the river runs past the old mill and the owls watch it " * 3}]
N = 12
# Several slots either way; the split cache is the default (one KV stream per slot).
LAYOUTS = {"split": {"slots": 3, "kv_unified": False}, "unified": {"slots": 3, "kv_unified": True}}
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
PAIRS = [("split", "split"), ("split", "unified"), ("unified", "split")]  # (made on, restored on)
MODELS = ["mamba_model", "hybrid_model"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("src", "dst"), PAIRS)
async def test_state_moves_between_layouts_and_continues(
    start_engine: Callable[..., Any], request: pytest.FixtureRequest, model: str, src: str, dst: str
) -> None:
    """PREFILL and STATE_GET on engine A (slot 1) answer OK with one blob; STATE_PUT puts it
    into engine B's slot 2, and a DECODE there continues as A's own DECODE of the same slot."""
    path = request.getfixturevalue(model)
    a = await start_engine(path, **ENGINE, **LAYOUTS[src], cache_ram_mib=0)
    b = await start_engine(path, **ENGINE, **LAYOUTS[dst], cache_ram_mib=0)
    async with await rpc(a) as ca, await rpc(b) as cb:
        pre = await ca.call(prefill_call(1, {"messages": MESSAGES}))
        assert pre.ok, pre.meta
        blob = parse_kv_blob(pre.payload)
        assert blob.n_past == pre.meta["n_past"] == len(blob.tokens) > 0
        assert blob.checkpoint is None  # none written, on any model (protocol §3)
        got = await ca.call(state_get_call(1))
        assert got.ok, got.meta
        state = parse_kv_blob(got.payload)
        n_logits = 4 * a.state.engine.n_vocab  # a PREFILL blob ends with the logits
        assert state.tokens == blob.tokens and bytes(state.state) == bytes(blob.state[:-n_logits])
        meta = await ca.call(state_meta_call(1))
        assert meta.meta["state_size"] == got.meta["state_size"] == len(state.state)

        put = await cb.call(state_put_call(2, got.payload))
        assert put.ok and put.meta["restored"] and put.meta["n_past"] == blob.n_past, put.meta
        # B's copy reads back as the same state: the same size and tokens (the bytes name
        # the sequence: slot 2's now).
        back = await cb.call(state_get_call(2))
        assert back.ok and parse_kv_blob(back.payload).tokens == blob.tokens
        assert len(parse_kv_blob(back.payload).state) == len(state.state)

        # A continues its own slot; B its restored one; and B's slot 0 from the PREFILL blob
        # (its logits give the first token).
        want = await decode_ok(ca, 1, frame(MESSAGES, n_predict=N))
        from_put = await decode_ok(cb, 2, frame(MESSAGES, n_predict=N))
        from_blob = await decode_ok(cb, 0, frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=kv_meta(pre)))
    async with http(a) as ha, http(b) as hb:
        reference = text_of(await get_result(ha, want))
        assert reference
        assert text_of(await get_result(hb, from_put)) == reference
        assert text_of(await get_result(hb, from_blob)) == reference
    await assert_server_healthy(a)
    await assert_server_healthy(b)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", ["split", "unified"])
async def test_pd_export_of_a_recurrent_model_is_restored_on_the_decode_engine(
    start_engine: Callable[..., Any], request: pytest.FixtureRequest, model: str, layout: str
) -> None:
    """kv_transfer_params: the prefill engine exports, the decode engine (the other layout)
    pulls and restores, and its text is the prefill engine's own."""
    other = "unified" if layout == "split" else "split"
    path = request.getfixturevalue(model)
    a = await start_engine(path, **ENGINE, **LAYOUTS[layout], cache_ram_mib=0)
    b = await start_engine(path, **ENGINE, **LAYOUTS[other], cache_ram_mib=0, kv_pull_timeout_s=5.0)
    body = {"messages": MESSAGES, "temperature": 0}
    async with http(a) as ha, http(b) as hb:
        reference, _ = await chat_text(ha, stream=False, **body, max_tokens=N)
        r = await ha.post("/v1/chat/completions", json={**body, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS})
        assert r.status_code == 200, r.text
        exported = r.json()
        assert exported["kv_export"]["exported"], exported
        params = exported["kv_transfer_params"]
        text, final = await chat_text(hb, stream=False, **body, max_tokens=N, kv_transfer_params=params)
    assert final["kv_transfer"]["status"] == "restored", final["kv_transfer"]
    assert final["kv_transfer"]["n_restored"] == params["hydra"]["n_past"]
    assert final["timings"]["prompt_n"] == 0  # nothing recomputed: the state and logits came along
    assert text == reference
    await assert_server_healthy(a)
    await assert_server_healthy(b)
