"""RPC ops on a live engine over real TCP: INFO, PREFILL, STATE_GET/PUT/META, CONFIGURE
(T1 and staged T2), the cross-engine hand-off, the HTTP slot-state routes and the idle
connection timeout."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import hydra_trio
from helpers import (
    ENGINE,
    MESSAGES,
    OTHER_MESSAGES,
    assert_error,
    assert_same_kv,
    assert_server_healthy,
    chat,
    http,
    rpc,
    wait_slots_until,
    wait_until,
)
from hydra_trio.rpc.client import (
    Call,
    build_decode_frame,
    decode_call,
    identity_kv_metadata,
    prefill_call,
)
from hydra_trio.wire import (
    Op,
    Status,
    encode_request,
    parse_kv_blob,
    parse_response_header,
    xxh3_tag,
)
from hydra_trio.wire.protocol import RESPONSE_HEADER, encode_request_header

IDENTITY_KEYS = (
    "model_alias", "model_path", "tokenizer", "model_name", "model_quant", "model_capabilities", "model_hash"
)
KV_HASH = re.compile(r"^xxh3:[0-9a-f]{16}$")


def sha256_of(model: Path) -> str:
    return hashlib.sha256(model.read_bytes()).hexdigest()


def assert_identity(meta: dict[str, Any], model: Path, alias: str) -> None:
    for key in IDENTITY_KEYS:
        assert key in meta, (key, meta)
    assert meta["model_alias"] == alias
    assert meta["model_path"] == str(model)
    assert isinstance(meta["model_capabilities"], int)
    assert meta["model_hash"] == sha256_of(model)  # the GGUF file's SHA-256, as the upstream protocol's


def strip_logits(payload: bytes | bytearray, n_vocab: int) -> bytes:
    """A PREFILL payload without its trailing logits (= what STATE_GET returns)."""
    assert len(payload) > 4 * n_vocab
    return bytes(payload[: len(payload) - 4 * n_vocab])


@pytest.fixture
async def engine(start_engine: Callable[..., Any], tiny_model: Path) -> Any:
    """The shared fixture's engine, single-threaded (see helpers.ENGINE)."""
    return await start_engine(tiny_model, **ENGINE)


# ---- INFO -----------------------------------------------------------------------------------


async def test_info(engine: Any, tiny_model: Path) -> None:
    async with await rpc(engine) as c:
        for key in (b"", b"0", b"1"):
            resp = await c.call(Call(Op.INFO, key, ()))
            assert resp.ok and resp.payload == b""
            m = resp.meta
            assert m["engine"] == "hydra-trio" and m["version"] == hydra_trio.__version__
            assert m["mode"] == "solo" and m["solo_active"] is True and m["pipeline_capable"] is False
            assert m["n_slots"] == 2 and m["n_ctx"] == 4096
            # The default split KV cache: each slot holds its share, and INFO says so.
            assert m["kv_unified"] is False and m["n_ctx_slot"] == 2048
            assert "tiny" in m["preset_aliases"]
            assert_identity(m, tiny_model, "tiny")
            assert m["model_name"] == "Hydra Synthetic Tiny" and m["model_quant"] == "F32"
            assert KV_HASH.match(m["tokenizer_hash"])
            caps = set(m["capabilities"])
            assert {
                "merged_decode",
                "prefill",
                "decode",
                "state_transfer",
                "tokenizer",
                "model_name",
                "model_quant",
                "model_capabilities",
                "model_hash",
            } <= caps


# ---- PREFILL --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_body",
    [
        {"messages": MESSAGES},
        {"messages": OTHER_MESSAGES},
        {"messages": MESSAGES, "add_generation_prompt": False},
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"prompt": "the water was very little"},
    ],
    ids=["messages", "system", "no-gen-prompt", "tools", "prompt"],
)
async def test_prefill_n_past_equals_prompt_tokens(engine: Any, tiny_model: Path, request_body: dict[str, Any]) -> None:
    async with await rpc(engine) as c:
        resp = await c.prefill(1, request_body)
    m = resp.meta
    n_vocab = 512
    assert m["logits_size"] == 4 * n_vocab
    assert m["state_size"] > 0 and m["prefill_ms"] >= 0
    assert KV_HASH.match(m["kv_hash"]) and m["kv_hash"] == xxh3_tag(resp.payload)
    assert_identity(m, tiny_model, "tiny")
    blob = parse_kv_blob(resp.payload)
    assert blob.n_past == m["n_past"] == len(blob.tokens)
    assert len(resp.payload) == 9 + 4 * blob.n_past + 1 + m["state_size"] + m["logits_size"]
    # The slot holds the prompt now (PREFILL leaves it there).
    async with await rpc(engine) as c:
        meta = (await c.state_meta(1)).meta
        assert meta["n_past"] == m["n_past"] and meta["state_size"] == m["state_size"]
        got = await c.state_get(1)
    assert bytes(got.payload) == strip_logits(resp.payload, n_vocab)
    # The same request over HTTP counts the same prompt tokens (a plain prompt is a text
    # completion there: the chat route wants messages).
    async with http(engine) as h:
        if "tools" in request_body:
            # The chat route refuses tools (replies are not parsed into tool calls); its
            # render route counts the prompt it would run, tools rendered as PREFILL does.
            r = await h.post("/v1/chat/completions/render", json=request_body)
            assert r.status_code == 200, r.text
            assert r.json()["count"] == m["n_past"]
            return
        if "messages" in request_body:
            body = await chat(h, **request_body, max_tokens=2)
        else:
            r = await h.post("/v1/completions", json={**request_body, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
    assert m["n_past"] == body["usage"]["prompt_tokens"]
    # The slot kept the PREFILL's logits with its KV: nothing of the prompt is evaluated again.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == m["n_past"]


async def test_prefill_replaces_slot_contents_and_is_deterministic(engine: Any) -> None:
    async with await rpc(engine) as c:
        first = await c.prefill(0, {"messages": MESSAGES})
        await c.prefill(0, {"messages": OTHER_MESSAGES})
        again = await c.prefill(0, {"messages": MESSAGES})
        other_slot = await c.prefill(1, {"messages": MESSAGES})
    assert bytes(again.payload) == bytes(first.payload)
    assert again.meta["kv_hash"] == first.meta["kv_hash"]
    assert_same_kv(first.payload, other_slot.payload)
    assert first.payload[-4 * 512 :] == other_slot.payload[-4 * 512 :]  # same logits


async def test_prefill_refusals_before_payload(engine: Any) -> None:
    async with await rpc(engine) as c:
        r = await c.call(Call(Op.PREFILL, b"9", [json.dumps({"messages": MESSAGES}).encode()]), check=False)
        assert_error(r, Status.NOT_FOUND, "NO_SLOT")
        r = await c.call(Call(Op.PREFILL, b"", [json.dumps({"messages": MESSAGES}).encode()]), check=False)
        assert_error(r, Status.BAD_REQUEST, "BAD_KEY")
        assert (await c.prefill(0, {"messages": MESSAGES})).ok
    await assert_server_healthy(engine)


async def test_prefill_refusals_after_payload(engine: Any) -> None:
    async with await rpc(engine) as c:
        assert_error(await c.call(Call(Op.PREFILL, b"0", [b"{nope"]), check=False), Status.ERROR, "BAD_JSON")
        r = await c.call(Call(Op.PREFILL, b"0", [b'{"max_tokens": 3}']), check=False)
        assert_error(r, Status.BAD_REQUEST, "BAD_JSON")
        r = await c.call(Call(Op.PREFILL, b"0", [json.dumps({"messages": []}).encode()]), check=False)
        assert_error(r, Status.BAD_REQUEST, "BAD_JSON")
        huge = {"messages": [{"role": "user", "content": "the " * 3000}]}
        r = await c.call(Call(Op.PREFILL, b"0", [json.dumps(huge).encode()]), check=False)
        assert_error(r, Status.BAD_REQUEST, "TOO_LARGE")
        # The connection is still in step after all of these.
        assert (await c.prefill(0, {"messages": MESSAGES})).ok
    await assert_server_healthy(engine)


async def test_prefill_and_state_ops_on_a_busy_slot(engine: Any) -> None:
    eng = engine.state.engine
    slot = eng._core.slots.claim(0, "test:holder")
    try:
        async with await rpc(engine) as c:
            body = json.dumps({"messages": MESSAGES}).encode()
            assert_error(await c.call(Call(Op.PREFILL, b"0", [body]), check=False), Status.BUSY, "SLOT_BUSY")
            assert_error(await c.call(Call(Op.STATE_GET, b"0", ()), check=False), Status.BUSY, "SLOT_BUSY")
            blob = (await c.state_get(1)).payload
            assert_error(await c.call(Call(Op.STATE_PUT, b"0", [blob]), check=False), Status.BUSY, "SLOT_BUSY")
            meta = await c.state_meta(0)  # cheap and allowed while busy
            assert meta.ok and meta.meta["is_processing"] is True
            assert (await c.prefill(1, {"messages": MESSAGES})).ok  # the other slot works
    finally:
        eng._core.slots.release(slot)
    await assert_server_healthy(engine)


# ---- STATE_GET / STATE_PUT / STATE_META -----------------------------------------------------


async def test_state_meta_fields(engine: Any, tiny_model: Path) -> None:
    async with await rpc(engine) as c:
        empty = (await c.state_meta(0)).meta
        assert empty["slot_id"] == 0 and empty["n_past"] == 0
        assert empty["is_processing"] is False and empty["is_transferring"] is False
        assert_identity(empty, tiny_model, "tiny")
        pre = (await c.prefill(0, {"messages": MESSAGES})).meta
        meta = (await c.state_meta(0)).meta
        assert meta["n_past"] == pre["n_past"]
        got = await c.state_get(0)
        assert meta["state_size"] == got.meta["state_size"] == len(parse_kv_blob(got.payload).state)


async def test_state_get_put_round_trip_same_engine(engine: Any, tiny_model: Path) -> None:
    async with await rpc(engine) as c:
        await c.prefill(0, {"messages": OTHER_MESSAGES})
        got = await c.state_get(0)
        m = got.meta
        assert m["kv_hash"] == xxh3_tag(got.payload)
        assert_identity(m, tiny_model, "tiny")
        blob = parse_kv_blob(got.payload)
        assert blob.n_past == m["n_past"] == len(blob.tokens)
        put = await c.state_put(1, got.payload)
        pm = put.meta
        assert pm["restored"] is True and pm["model_match"] is True
        assert pm["bytes"] == len(got.payload) and pm["n_past"] == blob.n_past
        assert_identity(pm, tiny_model, "tiny")
        again = await c.state_get(1)
        assert_same_kv(got.payload, again.payload)
        back = await c.state_put(0, again.payload)
        assert back.meta["n_past"] == blob.n_past
        assert bytes((await c.state_get(0)).payload) == bytes(got.payload)


def _as_fork_blob(v2: bytes, version: int) -> bytes:
    """The same slot as the C++ engine sends it, laid out field by field: v3 (version byte
    0x03, no checkpoint: flags 0) or the legacy unversioned blob (llama.cpp's sequence file:
    u32 'ggsq', u32 file version 2, u32 n_tok, tokens, state)."""
    blob = parse_kv_blob(v2)
    toks = struct.pack(f"<{len(blob.tokens)}i", *blob.tokens)
    if version == 3:
        return struct.pack("<BII", 0x03, blob.n_past, len(blob.tokens)) + toks + b"\x00" + bytes(blob.state)
    return struct.pack("<III", 0x67677371, 2, len(blob.tokens)) + toks + bytes(blob.state)


@pytest.mark.parametrize("version", [3, 0], ids=["v3", "legacy"])
async def test_fork_blobs_restore_and_generate_like_v2(
    start_engine: Callable[..., Any], tiny_model_ctx: Path, version: int
) -> None:
    """STATE_PUT of the C++ engine's v3 (and legacy) blob of a slot holds the same KV as the
    v2 blob of that slot, and generates the same text; STATE_GET still writes v2."""
    a = await start_engine(tiny_model_ctx, **ENGINE)
    req = {"messages": OTHER_MESSAGES}
    async with await rpc(a) as ca:
        await ca.prefill(1, req)
        v2 = bytes((await ca.state_get(1)).payload)
    texts = []
    for blob in (v2, _as_fork_blob(v2, version)):
        b = await start_engine(tiny_model_ctx, **ENGINE)
        async with await rpc(b) as cb:
            put = await cb.state_put(1, blob)
            assert put.meta["restored"] is True and put.meta["n_past"] == parse_kv_blob(v2).n_past
            got = bytes((await cb.state_get(1)).payload)
            assert got[0] == 0x02 and got == v2  # written as v2, whatever came in
        async with http(b) as hb:
            cont = await chat(hb, **req, max_tokens=24)
        assert cont["id_slot"] == 1
        texts.append(cont["choices"][0]["message"]["content"])
    assert texts[0] == texts[1]


async def test_empty_slot_state_round_trip(engine: Any) -> None:
    async with await rpc(engine) as c:
        got = await c.state_get(1)
        assert got.meta["n_past"] == 0 and parse_kv_blob(got.payload).tokens == []
        await c.prefill(0, {"messages": MESSAGES})
        put = await c.state_put(0, got.payload)  # restoring "nothing" empties the slot
        assert put.meta["n_past"] == 0
        assert (await c.state_meta(0)).meta["n_past"] == 0


async def test_cross_engine_handoff(start_engine: Callable[..., Any], tiny_model_ctx: Path) -> None:
    """PREFILL on A, STATE_PUT on B, B continues with the greedy text A produces alone."""
    a = await start_engine(tiny_model_ctx, **ENGINE)
    b = await start_engine(tiny_model_ctx, **ENGINE)
    assert a.rpc_port != b.rpc_port and a.http_port != b.http_port
    req = {"messages": OTHER_MESSAGES}
    async with http(a) as ha:
        alone = await chat(ha, **req, max_tokens=48)  # fresh A, no cached prefix
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    async with await rpc(a) as ca, await rpc(b) as cb:
        pre = await ca.prefill(1, req)
        n_past = pre.meta["n_past"]
        assert n_past == alone["usage"]["prompt_tokens"]
        put = await cb.state_put(1, pre.payload)
        assert put.meta["restored"] is True and put.meta["n_past"] == n_past
        assert put.meta["bytes"] == len(pre.payload)
        got = await cb.state_get(1)
        assert got.meta["n_past"] == n_past
        assert parse_kv_blob(got.payload).tokens == parse_kv_blob(pre.payload).tokens
        # Same KV bytes as A produced (the blob minus the logits).
        assert bytes(got.payload) == strip_logits(pre.payload, 512)
    async with http(b) as hb:
        cont = await chat(hb, **req, max_tokens=48)
    assert cont["id_slot"] == 1  # the slot holding the restored prompt
    # The blob's logits came along: B evaluates nothing of the prompt (the same computation
    # as A's whole-prompt prefill, so the same text).
    assert cont["usage"]["prompt_tokens_details"]["cached_tokens"] == n_past > 0
    assert cont["usage"]["prompt_tokens"] == n_past
    assert cont["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert cont["choices"][0]["finish_reason"] == alone["choices"][0]["finish_reason"]
    assert cont["usage"]["completion_tokens"] == alone["usage"]["completion_tokens"]


async def test_cross_engine_state_get_blob_without_logits(
    start_engine: Callable[..., Any], tiny_model_ctx: Path
) -> None:
    """A STATE_GET blob (no logits) hands over the same way."""
    a = await start_engine(tiny_model_ctx, **ENGINE, slots=1)
    b = await start_engine(tiny_model_ctx, **ENGINE, slots=1)
    req = {"messages": MESSAGES}
    async with http(a) as ha:
        alone = await chat(ha, **req, max_tokens=40)
    async with await rpc(a) as ca, await rpc(b) as cb:
        blob = (await ca.state_get(0)).payload  # prompt + generated tokens
        put = await cb.state_put(0, blob)
        # The last sampled token is evaluated only when generation went on past it (eos).
        last_unevaluated = alone["choices"][0]["finish_reason"] == "length"
        assert put.meta["n_past"] == alone["usage"]["total_tokens"] - last_unevaluated
        assert bytes((await cb.state_get(0)).payload) == bytes(blob)
    async with http(b) as hb, http(a) as ha:
        # Both engines hold the same KV: the same follow-up gives the same text.
        follow = [*req["messages"], {"role": "assistant", "content": alone["choices"][0]["message"]["content"]}]
        follow.append({"role": "user", "content": "and then"})
        on_a = await chat(ha, messages=follow, max_tokens=24)
        on_b = await chat(hb, messages=follow, max_tokens=24)
    assert on_b["choices"][0]["message"]["content"] == on_a["choices"][0]["message"]["content"]
    assert (
        on_b["usage"]["prompt_tokens_details"]["cached_tokens"]
        == on_a["usage"]["prompt_tokens_details"]["cached_tokens"]
    )


# ---- CONFIGURE ------------------------------------------------------------------------------


async def test_configure_t1(engine: Any) -> None:
    eng = engine.state.engine
    async with await rpc(engine) as c:
        settings = {
            "n_predict": 8,
            "seed": 42,
            "n_keep": 0,
            "antiprompt": "STOP",
            "sampling": {"temperature": 0.5, "top_k": 10, "penalty_repeat": 1.1, "bogus": 1},
            "state_chunk_size": 1,
            "not_a_key": True,
        }
        m = (await c.configure(1, settings)).meta
        assert m["success"] is True and m["tier"] == "T1" and m["deferred_keys"] == []
        applied = m["params_applied"]
        assert applied["n_predict"] == 8 and applied["seed"] == 42
        # No context shifting here: n_keep is accepted (and type-checked) but not applied.
        assert "n_keep" not in applied and "n_keep" not in eng._core.slot_settings.generation_defaults(1)
        assert "no context shifting" in m["params_unused"]["n_keep"]
        # Nothing dropped without a word: unknown keys are named, with why.
        assert set(m["params_unused"]) == {"n_keep", "sampling.bogus", "not_a_key"}
        assert applied["antiprompt"] == ["STOP"]
        assert applied["sampling"] == {"temperature": 0.5, "top_k": 10, "penalty_repeat": 1.1}
        assert applied["state_chunk_size"] == 64 * 1024  # clamped up
        assert "not_a_key" not in applied
        assert eng._core.slot_settings.generation_defaults(1)["n_predict"] == 8
        assert "n_predict" not in eng._core.slot_settings.generation_defaults(0)  # per slot

        m = (await c.configure(0, {"state_chunk_size": 1 << 40})).meta
        assert m["params_applied"] == {"state_chunk_size": 64 * 1024 * 1024}  # clamped down
        assert "params_unused" not in m
        m = (await c.configure(0, {"n_keep": 4})).meta
        assert m["params_applied"] == {} and list(m["params_unused"]) == ["n_keep"]
        m = (await c.configure(0, {"state_chunk_size": 100_000})).meta
        assert m["params_applied"] == {"state_chunk_size": 100_000}

        m = (await c.configure(None, {})).meta
        assert m == {"success": True, "tier": "T1", "params_applied": {}, "deferred_keys": []}
        m = (await c.configure(None, {"unknown": 1, "also": [1]})).meta  # named, never dropped
        assert m["success"] is True and m["params_applied"] == {} and sorted(m["params_unused"]) == ["also", "unknown"]
        m = (await c.call(Call(Op.CONFIGURE, b"", ()))).meta  # empty payload = {}
        assert m["tier"] == "T1" and m["params_applied"] == {}

        for bad in ({"n_predict": "8"}, {"sampling": {"top_k": "x"}}, {"antiprompt": 3}, {"sampling": 1}):
            r = await c.call(Call(Op.CONFIGURE, b"0", [json.dumps(bad).encode()]), check=False)
            assert not r.ok and r.meta["error_code"] == "BAD_JSON" and r.meta["error"], (bad, r.meta)
        # A small state_chunk_size only changes how STATE_GET is sent, not what.
        await c.prefill(0, {"messages": MESSAGES})
        await c.configure(0, {"state_chunk_size": 1})
        got = await c.state_get(0)
        assert got.meta["kv_hash"] == xxh3_tag(got.payload)


async def test_configure_t2_n_ctx_applied_once_idle(engine: Any) -> None:
    eng = engine.state.engine

    async def n_ctx() -> int:
        async with await rpc(engine) as c:
            return (await c.info()).meta["n_ctx"]

    async with await rpc(engine) as c:
        await c.prefill(0, {"messages": MESSAGES})
    holder = eng._core.slots.claim(1, "test:holder")  # a busy slot defers the rebuild
    released = False
    try:
        async with await rpc(engine) as c:
            m = (await c.configure(0, {"n_ctx": 1024, "seed": 7})).meta
        assert m["success"] is True and m["tier"] == "T2"
        assert m["deferred_keys"] == ["n_ctx"]
        assert m["params_applied"] == {"seed": 7}
        with trio.fail_after(5):
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        assert await n_ctx() == 4096, "T2 applied while a slot was busy"
        # New work waits for the staged change instead of keeping the engine busy forever.
        async with await rpc(engine) as c:
            r = await c.call(prefill_call(0, {"messages": MESSAGES}), check=False)
        assert r.status == Status.BUSY and "reconfiguring" in r.meta["error"], r.meta
        eng._core.slots.release(holder)
        released = True
        await wait_slots_until(eng, lambda: eng.n_ctx == 1024)
    finally:
        if not released:
            eng._core.slots.release(holder)
    # The new context serves requests; the rebuild dropped every slot's contents.
    async with await rpc(engine) as c:
        assert (await c.state_meta(0)).meta["n_past"] == 0
        assert (await c.prefill(0, {"messages": MESSAGES})).ok
    async with http(engine) as h:
        assert (await h.get("/slots")).json()[0]["n_ctx"] == 512  # 1024 cells, 2 slots
        assert (await chat(h, max_tokens=4))["usage"]["completion_tokens"] == 4
    await assert_server_healthy(engine)



async def test_configure_t2_refusals(engine: Any) -> None:
    async with await rpc(engine) as c:
        for bad in ({"n_ctx": 1}, {"n_ctx": "big"}, {"cache_type_k": "q9"}, {"model_path": ""}):
            r = await c.call(Call(Op.CONFIGURE, b"0", [json.dumps(bad).encode()]), check=False)
            assert not r.ok and r.meta["error_code"] == "BAD_JSON", (bad, r.meta)
        assert (await c.info()).meta["n_ctx"] == 4096


async def test_configure_t2_holds_the_cache_type_rule_of_start_up(start_engine: Any, tiny_model_hd32: Any) -> None:
    """A quantized V cache needs flash attention: refused at start-up (config.validate) and,
    by the same rule (config.cache_type_problem), by a T2 on an engine running without it,
    before anything is staged; with flash attention it is staged."""
    off = await start_engine(tiny_model_hd32, flash_attn="off")
    async with await rpc(off) as c:
        r = await c.call(Call(Op.CONFIGURE, b"0", [json.dumps({"cache_type_v": "q8_0"}).encode()]), check=False)
        assert not r.ok and r.meta["error_code"] == "BAD_JSON", r.meta
        assert "needs flash attention" in r.meta["error"]
        assert off.state.engine._core.reconfigurer.staged == {}


# ---- HTTP slot-state routes -----------------------------------------------------------------


async def test_http_state_routes(engine: Any) -> None:
    async with await rpc(engine) as c:
        pre = await c.prefill(0, {"messages": MESSAGES})
        rpc_blob = bytes((await c.state_get(0)).payload)
    async with http(engine) as h:
        r = await h.get("/slots/0/state/meta")
        assert r.status_code == 200, r.text
        meta = r.json()
        assert meta["slot_id"] == 0 and meta["n_past"] == pre.meta["n_past"] and meta["is_processing"] is False

        r = await h.get("/slots/0/state")
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/octet-stream")
        assert int(r.headers["x-hydra-n-past"]) == pre.meta["n_past"]
        assert int(r.headers["x-hydra-state-size"]) in (pre.meta["state_size"], len(r.content))
        assert r.content == rpc_blob

        r = await h.put("/slots/1/state", content=r.content, headers={"content-type": "application/octet-stream"})
        assert r.status_code == 200, r.text
        assert r.json()["n_past"] == pre.meta["n_past"]
        assert int(r.headers["x-hydra-n-past"]) == pre.meta["n_past"]
        assert_same_kv(rpc_blob, (await h.get("/slots/1/state")).content)
        # Back into slot 0 (same slot id): byte for byte what it was.
        r = await h.put("/slots/0/state", content=(await h.get("/slots/1/state")).content)
        assert r.status_code == 200, r.text
        assert (await h.get("/slots/0/state")).content == rpc_blob

        r = await h.put("/slots/1/state", content=b"\x04" + rpc_blob[1:])
        assert r.status_code == 400 and r.json()["error"]["message"]
        assert r.json()["error_code"] == "BAD_FRAME"
        assert (await h.get("/slots/1/state/meta")).json()["n_past"] == pre.meta["n_past"]

        r = await h.post("/slots/0", params={"action": "erase"})
        assert r.status_code == 200, r.text
        assert (await h.get("/slots/0/state/meta")).json()["n_past"] == 0
        assert (await h.post("/slots/0", params={"action": "explode"})).status_code == 400
        assert (await h.get("/slots/7/state/meta")).status_code == 404
        assert (await h.get("/slots/x/state/meta")).status_code == 400
    await assert_server_healthy(engine)


async def test_http_state_put_refused_by_llama(engine: Any) -> None:
    async with await rpc(engine) as c:
        blob = bytes((await c.prefill(0, {"messages": MESSAGES})).payload)
    head_len = 9 + 4 * parse_kv_blob(blob).n_tokens + 1
    corrupt = blob[:head_len] + b"\x00\x00\x00\x00" + blob[head_len + 4 :]  # llama state magic
    async with http(engine) as h:
        r = await h.put("/slots/1/state", content=corrupt)
        assert r.status_code == 422, r.text  # the caller's blob, not the engine, is at fault
        assert r.json()["error_code"] == "RESTORE_FAILED", r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "ExceptionGroup" not in r.json()["error"]["message"]
        meta = (await h.get("/slots/1/state/meta")).json()
        assert meta["n_past"] == 0 and meta["is_processing"] is False
    await assert_server_healthy(engine)


# ---- idle connections -----------------------------------------------------------------------


async def _read_until_eof(stream: trio.SocketStream, timeout_s: float) -> bytes:
    data = b""
    with trio.fail_after(timeout_s):
        while chunk := await stream.receive_some(65536):
            data += chunk
    return data


async def test_idle_connection_is_closed(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, **ENGINE, idle_timeout_s=0.5)
    # A connection that never sends anything.
    stream = await trio.open_tcp_stream("127.0.0.1", ep.rpc_port)
    t0 = trio.current_time()
    assert await _read_until_eof(stream, 10.0) == b""
    assert trio.current_time() - t0 >= 0.45
    await stream.aclose()
    # Idle after a request: exactly one reply, then the connection closes.
    stream = await trio.open_tcp_stream("127.0.0.1", ep.rpc_port)
    await stream.send_all(encode_request(Op.INFO))
    t0 = trio.current_time()
    data = await _read_until_eof(stream, 10.0)
    assert trio.current_time() - t0 >= 0.45
    head = parse_response_header(data[: RESPONSE_HEADER.size])
    assert head.status == Status.OK and head.payload_len == 0
    assert len(data) == RESPONSE_HEADER.size + head.meta_len
    assert json.loads(data[RESPONSE_HEADER.size :])["engine"] == "hydra-trio"
    await stream.aclose()
    # A request that stalls mid-payload is dropped after the same timeout, without a reply.
    stream = await trio.open_tcp_stream("127.0.0.1", ep.rpc_port)
    await stream.send_all(encode_request_header(Op.CONFIGURE, key_len=1, payload_len=100) + b"0" + b'{"seed":')
    assert await _read_until_eof(stream, 10.0) == b""
    await stream.aclose()
    # The server itself is fine.
    await assert_server_healthy(ep)


async def test_connection_bound_is_a_limiter(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    """More connections than max_connections wait for a place; none is refused or crashes."""
    ep = await start_engine(tiny_model, **ENGINE, max_connections=2)
    first, second = await rpc(ep), await rpc(ep)
    assert (await first.info()).ok and (await second.info()).ok  # both hold a place
    third = await rpc(ep)
    await third.send_raw(encode_request(Op.INFO))
    with trio.move_on_after(0.3) as waited:
        await third.read_response()
    assert waited.cancelled_caught, "a third connection was served while two were open"
    await first.aclose()  # frees a place: the waiting request is served
    with trio.fail_after(10):
        resp = await third.read_response()
    assert resp.ok and resp.meta["engine"] == "hydra-trio"
    assert (await second.info()).ok
    await second.aclose()
    await third.aclose()


async def test_configure_t3_reads_only_regular_files_inside_the_model_dir(
    start_engine: Callable[..., Any], tiny_model: Path, tmp_path: Path
) -> None:
    """A T3 model_path names a file the loader thread opens with every slot frozen: one
    outside --model-dir (also through a symlink or ..), or a FIFO that would block the loader
    forever, is refused in the CONFIGURE reply and nothing is staged."""
    import os

    fifo = tiny_model.parent / f"fifo-{os.getpid()}.gguf"
    os.mkfifo(fifo)
    link = tiny_model.parent / f"link-{os.getpid()}.gguf"
    link.symlink_to("/etc/hostname")
    ep = await start_engine(tiny_model)
    try:
        async with await rpc(ep) as c:
            for path, code, words in (
                ("/etc/hostname", "BAD_KEY", "inside --model-dir"),
                (f"../{tmp_path.name}/../../etc/hostname", "BAD_KEY", "inside --model-dir"),
                (str(link), "BAD_KEY", "inside --model-dir"),
                (str(fifo), "BAD_JSON", "not a regular file"),
                ("no-such.gguf", "BAD_JSON", "No such file"),
            ):
                r = await c.call(Call(Op.CONFIGURE, b"0", [json.dumps({"model_path": path}).encode()]), check=False)
                assert not r.ok and r.meta["error_code"] == code and words in r.meta["error"], (path, r.meta)
            assert ep.state.engine._core.reconfigurer.staged == {}
            # A relative name inside the folder is the file there.
            ok = await c.configure(0, {"model_path": tiny_model.name})
            assert ok.meta["tier"] == "T3"
    finally:
        fifo.unlink()
        link.unlink()


async def test_model_hash_follows_a_t3_reload(
    start_engine: Callable[..., Any], tiny_model: Path, tiny_model_other: Path
) -> None:
    """model_hash is the loaded file's: a CONFIGURE T3 reload of another GGUF changes it in
    INFO, STATE_META and PREFILL replies, and a DECODE carrying the old one is refused."""
    ep = await start_engine(tiny_model)
    async with await rpc(ep) as c:
        before = (await c.info()).meta["model_hash"]
        assert before == sha256_of(tiny_model)
        old = await c.prefill(0, {"messages": MESSAGES})
        assert (await c.configure(0, {"model_path": str(tiny_model_other)})).meta["tier"] == "T3"
    await wait_slots_until(ep.state.engine, lambda: ep.state.engine._core.t3_reloads == 1)
    async with await rpc(ep) as c:
        now = sha256_of(tiny_model_other)
        assert (await c.info()).meta["model_hash"] == now != before
        assert (await c.state_meta(1)).meta["model_hash"] == now
        assert (await c.prefill(1, {"messages": MESSAGES})).meta["model_hash"] == now
        md = {**identity_kv_metadata(old.meta, old.meta["n_past"]), "model_hash": before}
        r = await c.call(
            decode_call(0, build_decode_frame({"messages": MESSAGES}, bytes(old.payload), kv_metadata=md)), check=False
        )
    assert r.meta["error_code"] == "CAP_MISMATCH" and r.meta["match"]["model_hash_match"] is False, r.meta
    assert "model_hash mismatch" in r.meta["reason"]


async def test_model_hash_runs_in_a_thread_of_its_own(
    start_engine: Callable[..., Any], tiny_model: Path, tiny_model_other: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A T3 reload's hashing (seconds to minutes on a multi-GB file) is held mid-file: the
    event loop still answers INFO and the GPU worker still runs calls; then it finishes and
    the reload takes effect."""
    import threading

    from hydra_trio.engine import modelfile

    started, release = threading.Event(), threading.Event()
    real = modelfile.file_sha256

    def held(path: Any, *, between_chunks: Any = None) -> str:
        started.set()
        release.wait(30)
        return real(path, between_chunks=between_chunks)

    ep = await start_engine(tiny_model)
    core = ep.state.engine._core
    monkeypatch.setattr(modelfile, "file_sha256", held)
    try:
        async with await rpc(ep) as c:
            assert (await c.configure(0, {"model_path": str(tiny_model_other)})).meta["tier"] == "T3"
            await wait_until(started.is_set)
            with trio.fail_after(10):
                assert (await c.info()).meta["model_hash"] == sha256_of(tiny_model)  # the loop serves
                assert await core.worker.call(lambda: 7) == 7  # and the worker is free
            assert core.t3_reloads == 0
    finally:
        release.set()
    await wait_slots_until(ep.state.engine, lambda: core.t3_reloads == 1)
    assert ep.state.engine.identity.model_hash == sha256_of(tiny_model_other)


async def test_configure_tiers_can_be_switched_off(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, configure_tiers="T1")
    async with await rpc(ep) as c:
        for body in ({"n_ctx": 1024}, {"model_path": str(tiny_model)}):
            r = await c.call(Call(Op.CONFIGURE, b"0", [json.dumps(body).encode()]), check=False)
            assert not r.ok and r.meta["error_code"] == "BAD_KEY" and "is off on this engine" in r.meta["error"], r.meta
        assert (await c.configure(0, {"seed": 3})).meta["params_applied"] == {"seed": 3}
