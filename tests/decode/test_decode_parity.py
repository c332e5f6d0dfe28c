"""DECODE gives the same greedy text as /v1/chat/completions, whatever path the KV took
(spec §4, §6.1, §6.3): no KV, a PREFILL on the same engine, a PREFILL on another engine,
an extended prompt, v3 and simple frames. And hydra_metrics holds measured values."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from helpers import (
    EXTENDED_MESSAGES,
    HYDRA_METRICS_KEYS,
    INT32_MAX,
    MATCH_KEYS,
    MESSAGES,
    chat_completion,
    decode,
    decode_ok,
    frame,
    gate,
    get_result,
    http,
    kv_meta,
    prefill,
    rpc,
    slot_meta,
    text_of,
    v3_raw,
    wait_listed,
)
from hydra_trio.wire import Status, encode_decode_frame_simple

N = 40


def assert_metrics_shape(
    m: dict[str, Any], *, rid: int, slot: int, identity: dict[str, Any]
) -> None:
    assert HYDRA_METRICS_KEYS <= m.keys(), HYDRA_METRICS_KEYS - m.keys()
    assert m["decode_request_id"] == rid
    assert m["id_slot"] == slot
    assert m["model_identity"] == identity
    assert MATCH_KEYS <= m["match"].keys()
    assert m["t3_reloaded"] is False and m["t3_reload_ms"] == 0.0
    assert m["model_load_ms"] > 0
    assert m["validate_ms"] > 0
    assert m["prompt_ms"] > 0 and m["decode_ms"] > 0 and m["ttft_ms"] > 0
    assert m["decode_init_ms"] >= 0 and m["queue_wait_ms"] >= 0
    assert m["stop_type"] in ("eos", "word", "limit", "context")


def assert_same_as_chat(body: dict[str, Any], chat: dict[str, Any]) -> None:
    assert text_of(body) == text_of(chat)
    assert text_of(body)  # the tiny model says something
    assert body["usage"]["completion_tokens"] == chat["usage"]["completion_tokens"]
    assert body["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]
    assert body["choices"][0]["finish_reason"] == chat["choices"][0]["finish_reason"]


async def test_decode_without_kv_on_an_empty_slot_matches_chat(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c:
        chat = await chat_completion(h, MESSAGES, N)
        assert (await slot_meta(c, 1))["n_past"] == 0
        rid = await decode_ok(c, 1, frame(MESSAGES, n_predict=N))
        body = await get_result(h, rid)
    assert_same_as_chat(body, chat)
    m = body["hydra_metrics"]
    assert_metrics_shape(m, rid=rid, slot=1, identity=ep.state.engine.identity.fields())
    assert m["kv_bytes"] == 0 and m["n_common"] == 0 and m["logits_reused"] is False
    assert m["n_prompt_processed"] == body["usage"]["prompt_tokens"]
    assert m["model_fallback"] is False
    assert (
        body["id_slot"] == 1
        and body["id"]
        and body["model"] == ep.state.engine.identity.model_alias
    )


async def test_prefill_then_decode_with_empty_kv_on_the_same_engine(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c:
        chat = await chat_completion(h, MESSAGES, N)
        pre = await prefill(c, 0, MESSAGES)
        n_past = pre.meta["n_past"]
        resp = await decode(c, 0, frame(MESSAGES, n_predict=N))
        assert resp.status == Status.OK, resp.meta
        assert resp.meta["n_past_after_restore"] == n_past  # the slot's own KV, untouched
        assert resp.meta["kv_bytes"] == 0
        rid = resp.meta["decode_request_id"]
        body = await get_result(h, rid)
    assert_same_as_chat(body, chat)
    m = body["hydra_metrics"]
    assert_metrics_shape(m, rid=rid, slot=0, identity=ep.state.engine.identity.fields())
    # No KV came, but the slot kept the PREFILL's logits with its KV: the first token is
    # sampled from them, nothing is evaluated (the same computation as the chat's).
    assert m["logits_reused"] is True
    assert m["n_common"] == n_past
    assert m["n_prompt_processed"] == 0
    assert m["kv_bytes"] == 0
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == n_past


async def test_prefill_on_a_decode_on_b_matches_chat(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    a = await start_engine(tiny_model)
    b = await start_engine(tiny_model)
    async with http(a) as ha, http(b) as hb, await rpc(a) as ca, await rpc(b) as cb:
        chat_a = await chat_completion(ha, MESSAGES, N)
        pre = await prefill(ca, 0, MESSAGES)
        blob = bytes(pre.payload)
        n_past = pre.meta["n_past"]
        resp = await decode(cb, 1, frame(MESSAGES, blob, n_predict=N, kv_metadata=kv_meta(pre)))
        assert resp.status == Status.OK, resp.meta
        meta = resp.meta
        # §4.4: real values.
        assert meta["valid"] is True
        assert MATCH_KEYS <= meta["match"].keys()
        assert meta["match"]["tokenizer_match"] and meta["match"]["model_name_match"]
        assert meta["match"]["model_quant_match"] and meta["match"]["model_capabilities_match"]
        assert (
            meta["match"]["capabilities_xor"] == 0 and meta["match"]["capabilities_diff_bits"] == []
        )
        rid = meta["decode_request_id"]
        assert isinstance(rid, int) and 0 < rid <= INT32_MAX
        assert meta["n_past_after_restore"] == n_past
        assert meta["restore_slot_ms"] > 0
        assert meta["decode_init_ms"] >= 0
        assert meta["kv_bytes"] == len(blob)
        assert meta["id_slot"] == 1
        body = await get_result(hb, rid)
        chat_b = await chat_completion(hb, MESSAGES, N)
        after = await slot_meta(cb, 1)
    assert_same_as_chat(body, chat_a)
    assert_same_as_chat(body, chat_b)
    m = body["hydra_metrics"]
    assert_metrics_shape(m, rid=rid, slot=1, identity=b.state.engine.identity.fields())
    assert m["logits_reused"] is True  # the prompt is exactly the prefilled one
    assert m["n_common"] == n_past
    assert m["n_prompt_processed"] == 0
    assert m["kv_bytes"] == len(blob)
    assert m["restore_slot_ms"] > 0
    assert m["model_fallback"] is False
    assert m["match"] == meta["match"]
    completion = body["usage"]["completion_tokens"]
    assert completion > 1 and m["tokens_per_s"] > 0
    if m["stop_type"] == "limit":
        assert completion == N and body["choices"][0]["finish_reason"] == "length"
    # n_past: prompt + generated tokens held in the KV (the last sampled one is not evaluated).
    assert m["n_past"] == after["n_past"] == n_past + completion - 1
    assert body["usage"]["prompt_tokens"] == n_past
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == n_past
    assert body["usage"]["total_tokens"] == n_past + completion
    assert body["timings"]["predicted_n"] == completion


async def test_decode_prompt_extending_the_prefilled_one(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    a = await start_engine(tiny_model)
    b = await start_engine(tiny_model)
    async with http(b) as hb, await rpc(a) as ca, await rpc(b) as cb:
        # No generation prompt: the extended conversation's rendering starts with this one.
        pre = await prefill(ca, 0, MESSAGES, add_generation_prompt=False)
        n_past = pre.meta["n_past"]
        blob = bytes(pre.payload)
        rid = await decode_ok(
            cb, 0, frame(EXTENDED_MESSAGES, blob, n_predict=N, kv_metadata=kv_meta(pre))
        )
        body = await get_result(hb, rid)
        chat = await chat_completion(hb, EXTENDED_MESSAGES, N)
    assert_same_as_chat(body, chat)
    m = body["hydra_metrics"]
    assert_metrics_shape(m, rid=rid, slot=0, identity=b.state.engine.identity.fields())
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert prompt_tokens > n_past
    assert m["n_common"] == n_past
    assert m["n_prompt_processed"] == prompt_tokens - n_past
    assert m["logits_reused"] is False  # the prompt goes beyond the logits' position
    assert m["model_fallback"] is False
    assert m["kv_bytes"] == len(blob) and m["restore_slot_ms"] > 0
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == n_past


async def test_v3_and_simple_frames_give_the_same_result(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c:
        pre = await prefill(c, 0, MESSAGES)
        blob = bytes(pre.payload)
        md = kv_meta(pre)
        v3 = await decode_ok(c, 1, frame(MESSAGES, blob, n_predict=N, kv_metadata=md))
        r_v3 = await get_result(h, v3)
        simple_header = {
            "model": ep.state.engine.identity.model_alias,
            "kv_metadata": md,
            "model_metadata": md,
            "generation": {"n_predict": N, "sampling": {"temperature": 0}},
            "prompt": {"messages": MESSAGES},
        }
        simple = await decode_ok(c, 1, encode_decode_frame_simple(simple_header, blob))
        r_simple = await get_result(h, simple)
        # The simple frame's prompt may also be a bare messages array.
        bare = await decode_ok(
            c, 1, encode_decode_frame_simple({**simple_header, "prompt": MESSAGES}, blob)
        )
        r_bare = await get_result(h, bare)
    assert len({v3, simple, bare}) == 3
    for r in (r_simple, r_bare):
        assert text_of(r) == text_of(r_v3)
        assert r["usage"] == r_v3["usage"]
        m = r["hydra_metrics"]
        for key in (
            "n_common",
            "n_prompt_processed",
            "logits_reused",
            "kv_bytes",
            "stop_type",
            "match",
        ):
            assert m[key] == r_v3["hydra_metrics"][key], key
    assert r_v3["hydra_metrics"]["logits_reused"] is True


async def test_queue_wait_and_restore_time_are_measured(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """The restore waits behind work holding the GPU worker: queue_wait_ms and
    restore_slot_ms report at least the time the test held the worker after it queued."""
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c, await rpc(ep) as c2:
        pre = await prefill(c, 0, MESSAGES)
        payload = frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=kv_meta(pre))
        reply: dict[str, Any] = {}

        async def send() -> None:
            reply["resp"] = await decode(c2, 1, payload)

        async with trio.open_nursery() as nursery:
            async with gate(ep) as g:
                nursery.start_soon(send)
                await g.wait_queued(1)
                t0 = time.perf_counter()
                # Some real work while the restore waits: HTTP round trips.
                entry = await wait_listed(h, "restoring")
                assert (await h.get(f"/v1/decode/{entry['decode_request_id']}")).status_code == 202
                held_ms = (time.perf_counter() - t0) * 1000.0
        resp = reply["resp"]
        assert resp.status == Status.OK, resp.meta
        body = await get_result(h, resp.meta["decode_request_id"])
    m = body["hydra_metrics"]
    assert m["queue_wait_ms"] + 0.001 >= held_ms > 0
    assert m["restore_slot_ms"] + 0.001 >= m["queue_wait_ms"]
    assert resp.meta["restore_slot_ms"] == m["restore_slot_ms"]
    assert m["validate_ms"] > 0 and m["decode_init_ms"] >= 0
    assert m["logits_reused"] is True


async def test_empty_prompt_segment_continues_the_slot(
    start_engine: Callable[..., Any], tiny_model_ctx: Path
) -> None:
    """Spec §4.1: the prompt segment may be empty; decoding then continues from what the slot
    holds (after a PREFILL, or after the DECODE's own KV), and gives the chat's text."""
    ep = await start_engine(tiny_model_ctx)
    async with http(ep) as h, await rpc(ep) as c:
        expected = text_of(await chat_completion(h, MESSAGES, N))
        # A PREFILL on this engine, then a v3 frame whose prompt segment is empty (0 bytes).
        await prefill(c, 0, MESSAGES)
        rid = await decode_ok(c, 0, v3_raw({"generation": {"n_predict": N, "temperature": 0}}, b"", b""))
        assert text_of(await get_result(h, rid)) == expected
        # Another slot's PREFILL blob (with logits) in the kv segment; a prompt segment with
        # generation settings but no prompt: the first token comes from the logits.
        pre = await prefill(c, 1, MESSAGES)
        rid = await decode_ok(c, 0, frame(None, pre.payload, n_predict=N, kv_metadata=kv_meta(pre)))
        body = await get_result(h, rid)
        assert text_of(body) == expected
        assert body["hydra_metrics"]["logits_reused"] is True
        assert body["usage"]["prompt_tokens"] == pre.meta["n_past"]
        # An empty slot and no prompt: nothing to continue, refused before anything runs.
        assert (await h.post("/slots/1?action=erase")).status_code == 200
        resp = await decode(c, 1, frame(None, n_predict=N))
        assert resp.status == Status.BAD_REQUEST and resp.meta["error_code"] == "BAD_JSON", resp.meta
        assert "no KV to continue from" in resp.meta["error"]
        assert (await slot_meta(c, 1))["is_processing"] is False
