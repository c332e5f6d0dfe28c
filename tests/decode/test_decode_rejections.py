"""DECODE refusals write nothing (spec §4.1, §4.2, §6.4).

Every refused DECODE targets slot 0, which holds a PREFILL of OTHER_MESSAGES, and carries a
valid-looking KV blob of a different prompt: had anything been restored, slot 0's tokens
would differ. Each case is checked twice:
  * ``test_refusal_writes_nothing``: the reply is not OK, the target slot holds exactly what it
    held before (STATE_META n_past, STATE_GET tokens), the other slot too, and a following
    DECODE on the target slot works;
  * ``test_refusal_reply``: the reply's status, error_code and meta (CAP_MISMATCH: valid,
    match, decode_request_id, reason).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from helpers import (
    MATCH_KEYS,
    MESSAGES,
    OTHER_MESSAGES,
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
    slot_tokens,
    store,
    text_of,
    v3_raw,
)
from hydra_trio.rpc.client import RpcResponse
from hydra_trio.wire import Status, parse_kv_blob, xxh3_64, xxh3_tag

N = 12


@dataclass
class Ctx:
    """What a case builds its frame from."""

    blob: bytes  # a valid PREFILL blob (MESSAGES) made by the case's source model
    md: dict[str, Any]  # its kv_metadata
    alias: str  # the resident model's alias
    info: dict[str, Any]  # the source engine's INFO meta


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Ctx], bytes]
    status: Status
    code: str
    slot: int = 0
    source: str = "tiny_model"  # fixture of the model that made the KV
    settings: dict[str, Any] = field(default_factory=dict)
    writes_bug: str | None = None  # known bug breaking "writes nothing"
    reply_bug: str | None = None  # known bug breaking the reply


def _req(ctx: Ctx, **md: Any) -> bytes:
    return frame(MESSAGES, ctx.blob, n_predict=N, kv_metadata={**ctx.md, **md})


def _header(ctx: Ctx) -> dict[str, Any]:
    return {
        "model": "",
        "kv_metadata": ctx.md,
        "model_metadata": ctx.md,
        "generation": {"n_predict": N},
    }


def _prompt() -> bytes:
    import json

    return json.dumps({"messages": MESSAGES, "temperature": 0}).encode()


def _wrong_header_hash(ctx: Ctx) -> bytes:
    good = v3_raw(_header(ctx), _prompt(), ctx.blob)
    hdr_len = int.from_bytes(good[:4], "little")
    actual = xxh3_64(good[12 : 12 + hdr_len])
    wrong = actual ^ (1 << 40)
    assert wrong & 0xFF != ord("{")  # else the frame would read as a simple frame
    return v3_raw(_header(ctx), _prompt(), ctx.blob, header_hash=wrong)


def _wrong_kv_hash(ctx: Ctx) -> bytes:
    return v3_raw(_header(ctx), _prompt(), ctx.blob, kv_hash=xxh3_tag(ctx.blob + b"x"))


def _wrong_prompt_hash(ctx: Ctx) -> bytes:
    return v3_raw(_header(ctx), _prompt(), ctx.blob, prompt_hash=xxh3_tag(b"another prompt"))


def _state_offset(blob: bytes) -> int:
    return len(blob) - len(parse_kv_blob(blob).state)


def _corrupt_state(ctx: Ctx) -> bytes:
    # The llama state's own header zeroed: llama.cpp refuses it. Empty hash: not checked.
    off = _state_offset(ctx.blob)
    bad = ctx.blob[:off] + b"\0" * 64 + ctx.blob[off + 64 :]
    return v3_raw(_header(ctx), _prompt(), bad)


def _wrong_n_past(ctx: Ctx) -> bytes:
    n_past = parse_kv_blob(ctx.blob).n_past
    bad = ctx.blob[:1] + (n_past + 1).to_bytes(4, "little") + ctx.blob[5:]
    return v3_raw(_header(ctx), _prompt(), bad)


def _truncated_logits(ctx: Ctx) -> bytes:
    # The state is intact; the trailing logits lost 100 bytes (neither absent nor n_vocab*4).
    return v3_raw(_header(ctx), _prompt(), ctx.blob[:-100])


def _oversized_header(ctx: Ctx) -> bytes:
    return frame(MESSAGES, ctx.blob, n_predict=N, kv_metadata={**ctx.md, "padding": "x" * 1024})


def _with_tokenizer_hash(ctx: Ctx) -> bytes:
    return _req(ctx, tokenizer_hash=ctx.info["tokenizer_hash"])


CASES = [
    Case(
        "wrong_tokenizer",
        lambda ctx: _req(ctx, tokenizer="gpt2/qwen2"),
        Status.ERROR,
        "CAP_MISMATCH",
    ),
    Case(
        "wrong_name",
        lambda ctx: _req(ctx, model_name="Other Tiny", model_alias="other-tiny"),
        Status.ERROR,
        "CAP_MISMATCH",
    ),
    # Real KV of a different model (same shape, other weights and name), its real identity.
    Case(
        "other_model_kv",
        lambda ctx: _req(ctx),
        Status.ERROR,
        "CAP_MISMATCH",
        source="tiny_model_other",
    ),
    Case(
        "mtp_difference",
        lambda ctx: _req(ctx, model_capabilities=0x01),
        Status.ERROR,
        "CAP_MISMATCH",
    ),
    Case(
        "vision_difference",
        lambda ctx: _req(ctx, model_capabilities=0x02),
        Status.ERROR,
        "CAP_MISMATCH",
    ),
    # Real KV of a model with another vocabulary: its tokenizer_hash (INFO) gives it away.
    Case(
        "other_vocab_tokenizer_hash",
        _with_tokenizer_hash,
        Status.ERROR,
        "CAP_MISMATCH",
        source="tiny_model_wide",
    ),
    # Same, without the hash: identity claims pass, the blob's logits have the wrong size.
    Case(
        "other_vocab_kv",
        lambda ctx: _req(ctx),
        Status.ERROR,
        "RESTORE_FAILED",
        source="tiny_model_wide",
    ),
    # The resident model's own KV, every claim right but model_hash (another GGUF file's).
    Case(
        "model_hash_mismatch",
        lambda ctx: _req(ctx, model_hash="0" * 64),
        Status.ERROR,
        "CAP_MISMATCH",
    ),
    Case("header_hash_mismatch", _wrong_header_hash, Status.BAD_REQUEST, "HASH_MISMATCH"),
    Case("kv_hash_mismatch", _wrong_kv_hash, Status.BAD_REQUEST, "HASH_MISMATCH"),
    Case("prompt_hash_mismatch", _wrong_prompt_hash, Status.BAD_REQUEST, "HASH_MISMATCH"),
    Case(
        "corrupt_kv_state",
        _corrupt_state,
        Status.ERROR,
        "RESTORE_FAILED",
    ),
    Case(
        "corrupt_kv_n_past",
        _wrong_n_past,
        Status.ERROR,
        "RESTORE_FAILED",
    ),
    Case(
        "corrupt_kv_trailing_bytes",
        _truncated_logits,
        Status.ERROR,
        "RESTORE_FAILED",
    ),
    Case(
        "oversized_header",
        _oversized_header,
        Status.BAD_REQUEST,
        "TOO_LARGE",
        settings={"max_decode_header_bytes": 512},
    ),
    # Refused before the payload is read (precheck).
    Case("missing_slot", lambda ctx: _req(ctx), Status.NOT_FOUND, "NO_SLOT", slot=7),
]


@dataclass
class Refused:
    ep: Any
    c: Any
    h: Any
    resp: RpcResponse
    before: dict[int, list[int]]  # slot -> tokens before the refused DECODE
    blob: bytes  # a valid blob (MESSAGES) of the resident model
    md: dict[str, Any]


@asynccontextmanager
async def refused(
    case: Case, start_engine: Callable[..., Any], request: pytest.FixtureRequest
) -> AsyncIterator[Refused]:
    ep = await start_engine(request.getfixturevalue("tiny_model"), **case.settings)
    if case.source == "tiny_model":
        src = ep
    else:
        src = await start_engine(request.getfixturevalue(case.source))
    async with http(ep) as h, await rpc(ep) as c, await rpc(src) as cs:
        own = await prefill(c, 1, MESSAGES)
        foreign = own if src is ep else await prefill(cs, 0, MESSAGES)
        info = (await cs.info()).meta
        ctx = Ctx(
            bytes(foreign.payload), kv_meta(foreign), ep.state.engine.identity.model_alias, info
        )
        await prefill(c, 0, OTHER_MESSAGES)
        before = {slot: await slot_tokens(c, slot) for slot in (0, 1)}
        assert before[0] != parse_kv_blob(ctx.blob).tokens
        resp = await decode(c, case.slot, case.build(ctx))
        yield Refused(ep, c, h, resp, before, bytes(own.payload), kv_meta(own))


def _params(which: str) -> list[Any]:
    out = []
    for case in CASES:
        bug = case.writes_bug if which == "writes" else case.reply_bug
        marks = [pytest.mark.xfail(reason=bug, strict=True)] if bug else []
        out.append(pytest.param(case, id=case.name, marks=marks))
    return out


@pytest.mark.parametrize("case", _params("writes"))
async def test_refusal_writes_nothing(
    case: Case, start_engine: Callable[..., Any], request: pytest.FixtureRequest
) -> None:
    async with refused(case, start_engine, request) as r:
        assert r.resp.status != Status.OK, r.resp.meta
        assert r.resp.payload == b""
        for slot, tokens in r.before.items():
            meta = await slot_meta(r.c, slot)
            assert meta["is_processing"] is False and meta["is_transferring"] is False
            assert meta["n_past"] == len(tokens), slot
            assert await slot_tokens(r.c, slot) == tokens, slot
        assert not store(r.ep).running()
        # The slot is usable: a valid DECODE into it restores and generates.
        target = case.slot if case.slot < 2 else 0
        rid = await decode_ok(r.c, target, frame(MESSAGES, r.blob, n_predict=N, kv_metadata=r.md))
        body = await get_result(r.h, rid)
        assert text_of(body) == text_of(await chat_completion(r.h, MESSAGES, N))
        assert body["hydra_metrics"]["logits_reused"] is True


@pytest.mark.parametrize("case", _params("reply"))
async def test_refusal_reply(
    case: Case, start_engine: Callable[..., Any], request: pytest.FixtureRequest
) -> None:
    async with refused(case, start_engine, request) as r:
        meta = r.resp.meta
        assert (Status(r.resp.status).name, meta.get("error_code")) == (
            case.status.name,
            case.code,
        ), meta
        assert isinstance(meta.get("error"), str) and meta["error"]
        if case.code in ("CAP_MISMATCH", "RESTORE_FAILED"):
            # Refused after the request got an id: the id is in the reply and readable.
            rid = meta["decode_request_id"]
            assert isinstance(rid, int) and rid > 0
            g = await r.h.get(f"/v1/decode/{rid}")
            assert g.status_code == 400, g.text
            assert g.json()["error_code"] == "DECODE_FAILED"
        else:
            assert len(store(r.ep)) == 0  # no request was created
        if case.code == "CAP_MISMATCH":
            assert meta["valid"] is False
            assert MATCH_KEYS <= meta["match"].keys()
            assert isinstance(meta["reason"], str) and meta["reason"]
            m = meta["match"]
            if case.name == "wrong_tokenizer":
                assert m["tokenizer_match"] is False and m["model_name_match"] is True
            if case.name in ("wrong_name", "other_model_kv"):
                assert m["model_name_match"] is False and m["model_alias_match"] is False
                assert m["tokenizer_match"] is True
            if case.name == "mtp_difference":
                assert m["capabilities_diff_bits"] == ["MTP"] and m["capabilities_xor"] == 0x01
            if case.name == "vision_difference":
                assert m["capabilities_diff_bits"] == ["VISION"] and m["capabilities_xor"] == 0x02
            if case.name == "other_vocab_tokenizer_hash":
                assert m["tokenizer_hash_match"] is False
            if case.name == "model_hash_mismatch":
                assert m["model_hash_match"] is False and m["tokenizer_match"] and m["model_name_match"]
                assert meta["reason"].startswith("model_hash mismatch")


# ---- accepted despite differences ---------------------------------------------------------


async def _accepted(
    c: Any, h: Any, slot: int, payload: bytes
) -> tuple[dict[str, Any], dict[str, Any]]:
    resp = await decode(c, slot, payload)
    assert resp.status == Status.OK, resp.meta
    assert resp.meta["valid"] is True
    body = await get_result(h, resp.meta["decode_request_id"])
    assert body["hydra_metrics"]["match"] == resp.meta["match"]
    return resp.meta["match"], body


@pytest.mark.parametrize("rescue", ["kv_metadata_alias", "header_model"])
async def test_other_model_name_is_rescued_by_the_resident_alias(
    rescue: str, start_engine: Callable[..., Any], tiny_model: Path, tiny_model_other: Path
) -> None:
    ep = await start_engine(tiny_model)
    other = await start_engine(tiny_model_other)
    alias = ep.state.engine.identity.model_alias
    async with http(ep) as h, await rpc(ep) as c, await rpc(other) as co:
        pre = await prefill(co, 0, MESSAGES)
        md = kv_meta(pre)
        assert md["model_name"] != ep.state.engine.identity.model_name
        if rescue == "kv_metadata_alias":
            payload = frame(
                MESSAGES, pre.payload, n_predict=N, kv_metadata={**md, "model_alias": alias}
            )
        else:
            payload = frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=md, model=alias)
        match, body = await _accepted(c, h, 0, payload)
    assert match["model_name_match"] is True and match["model_alias_match"] is True
    assert match["tokenizer_match"] is True
    assert body["usage"]["completion_tokens"] > 0


async def test_the_resident_model_hash_is_accepted(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    """kv_metadata.model_hash equal to the resident GGUF's SHA-256 (INFO's): checked, accepted."""
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c:
        pre = await prefill(c, 0, MESSAGES)
        md = {**kv_meta(pre), "model_hash": pre.meta["model_hash"]}
        match, body = await _accepted(c, h, 1, frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=md))
        chat = await chat_completion(h, MESSAGES, N)
    assert match["model_hash_match"] is True
    assert text_of(body) == text_of(chat)


async def test_quant_difference_is_accepted_and_reported(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c:
        pre = await prefill(c, 0, MESSAGES)
        md = {**kv_meta(pre), "model_quant": "Q4_K_M"}
        match, body = await _accepted(
            c, h, 1, frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=md)
        )
        chat = await chat_completion(h, MESSAGES, N)
    assert match["model_quant_match"] is False
    assert (
        match["tokenizer_match"] and match["model_name_match"] and match["model_capabilities_match"]
    )
    assert text_of(body) == text_of(chat)


@pytest.mark.parametrize(("bit", "name"), [(0x04, "REASONING"), (0x08, "TOOL_USE"), (0x10, "CODE")])
async def test_non_rejecting_capability_difference_is_reported(
    bit: int, name: str, start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)
    assert ep.state.engine.identity.model_capabilities == 0
    async with http(ep) as h, await rpc(ep) as c:
        pre = await prefill(c, 0, MESSAGES)
        md = {**kv_meta(pre), "model_capabilities": bit}
        match, _ = await _accepted(
            c, h, 1, frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=md)
        )
    assert match["model_capabilities_match"] is False
    assert match["capabilities_xor"] == bit
    assert match["capabilities_diff_bits"] == [name]


# ---- busy slot, full result store -----------------------------------------------------------


@dataclass
class BusyScenario:
    ep: Any
    resp: RpcResponse  # the refused DECODE's reply
    running_rid: int


@asynccontextmanager
async def busy_slot(
    start_engine: Callable[..., Any], tiny_model: Path
) -> AsyncIterator[tuple[BusyScenario, Any, Any]]:
    """Slot 0 held by a generating DECODE (paused at the GPU worker); a second DECODE with a
    KV blob is sent to slot 0."""
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c, await rpc(ep) as c2:
        pre = await prefill(c, 1, MESSAGES)
        async with gate(ep):
            rid = await decode_ok(c, 0, frame(OTHER_MESSAGES, n_predict=N))
            resp = await decode(
                c2, 0, frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=kv_meta(pre))
            )
            scenario = BusyScenario(ep, resp, rid)
            # Checked while the first request still runs: it is the only one, still going.
            assert [e.id for e in store(ep).entries()] == [rid]
            assert store(ep).get(rid).state.value == "generating"
            assert (await slot_meta(c, 0))["is_processing"] is True
        yield scenario, h, c


async def test_busy_slot_refusal_leaves_the_running_request_alone(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    async with busy_slot(start_engine, tiny_model) as (s, h, c):
        assert s.resp.status != Status.OK
        body = await get_result(h, s.running_rid)
        assert text_of(body) == text_of(await chat_completion(h, OTHER_MESSAGES, N))
        n_after = body["hydra_metrics"]["n_past"]
        assert (await slot_meta(c, 0))["n_past"] == n_after
        pre = await prefill(c, 1, MESSAGES)
        rid = await decode_ok(
            c, 0, frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=kv_meta(pre))
        )
        assert text_of(await get_result(h, rid)) == text_of(await chat_completion(h, MESSAGES, N))


async def test_busy_slot_reply(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    async with busy_slot(start_engine, tiny_model) as (s, _h, _c):
        assert (Status(s.resp.status).name, s.resp.meta.get("error_code")) == (
            "BUSY",
            "SLOT_BUSY",
        ), s.resp.meta


@asynccontextmanager
async def full_store(
    start_engine: Callable[..., Any], tiny_model: Path
) -> AsyncIterator[tuple[BusyScenario, Any, Any, list[int]]]:
    """decode_result_max=1 and one DECODE running (paused at the worker) on slot 0; a second
    DECODE targets the free slot 1, which holds a PREFILL of OTHER_MESSAGES."""
    ep = await start_engine(tiny_model, decode_result_max=1)
    async with http(ep) as h, await rpc(ep) as c:
        pre = await prefill(c, 1, MESSAGES)
        await prefill(c, 1, OTHER_MESSAGES)
        before = await slot_tokens(c, 1)
        async with gate(ep):
            rid = await decode_ok(c, 0, frame(OTHER_MESSAGES, n_predict=N))
            resp = await decode(
                c, 1, frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=kv_meta(pre))
            )
            meta1 = await slot_meta(c, 1)
            assert meta1["is_processing"] is False and meta1["n_past"] == len(before)
            assert [e.id for e in store(ep).entries()] == [rid]
        yield BusyScenario(ep, resp, rid), h, c, before


async def test_full_result_store_refusal_writes_nothing(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    async with full_store(start_engine, tiny_model) as (s, h, c, before):
        assert s.resp.status != Status.OK
        body = await get_result(h, s.running_rid)
        assert await slot_tokens(c, 1) == before
        assert text_of(body) == text_of(await chat_completion(h, OTHER_MESSAGES, N))
        # The first request is finished now: it is evicted to make room for the next one.
        pre = await prefill(c, 0, MESSAGES)
        rid = await decode_ok(
            c, 1, frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=kv_meta(pre))
        )
        assert text_of(await get_result(h, rid)) == text_of(await chat_completion(h, MESSAGES, N))
        gone = await h.get(f"/v1/decode/{s.running_rid}")
        assert gone.status_code == 410 and gone.json()["state"] == "evicted"


async def test_full_result_store_reply(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    async with full_store(start_engine, tiny_model) as (s, _h, _c, _before):
        assert (Status(s.resp.status).name, s.resp.meta.get("error_code")) == (
            "BUSY",
            "RESULT_STORE_FULL",
        ), s.resp.meta
