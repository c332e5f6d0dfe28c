"""KV cache types (--cache-type-k/-v, llama-server's -ctk/-ctv) and the layout gate: KV made
in another layout (K/V types, V transposition) is refused before any byte moves or any slot
is touched, naming the difference."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from helpers import MESSAGES, decode, frame, http, kv_meta, prefill, rpc, slot_tokens
from hydra_trio.config import settings_from
from hydra_trio.rpc.client import RpcResponse, state_put_call
from hydra_trio.wire import Status

N = 8
PD = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
      "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


def test_a_quantized_v_without_flash_attention_is_a_startup_error_naming_both_flags() -> None:
    with pytest.raises(SystemExit, match=r"cache_type_v q8_0 is quantized.*--flash-attn on or auto"):
        settings_from(None, env={}, cache_type_v="q8_0", flash_attn="off")
    with pytest.raises(SystemExit, match="cache_type_k must be one of"):
        settings_from(None, env={}, cache_type_k="q9")
    assert settings_from(None, env={"HYDRA_CACHE_TYPE_K": "q8_0"}).cache_type_k == "q8_0"


async def test_the_layout_is_reported_and_q8_0_blobs_are_about_half(
    start_engine: Callable[..., Any], tiny_model_hd32: Path
) -> None:
    sizes = {}
    for kind in ("f16", "q8_0"):
        ep = await start_engine(tiny_model_hd32, cache_type_k=kind, cache_type_v=kind, flash_attn="on")
        async with http(ep) as h:
            layout = (await h.get("/version")).json()["kv_cache"]
        assert layout == {"type_k": kind, "type_v": kind, "v_trans": False}
        c = await rpc(ep)
        async with c:
            assert (await c.info()).meta["kv_cache"] == layout
        b = ep.state.engine._core.backend
        sizes[kind] = b.state_size_for(1001) - b.state_size_for(1)  # per 1000 positions
    # q8_0 stores 34 bytes per 32 values, f16 64 (the cell metadata is the same for both).
    assert sizes["q8_0"] <= 0.55 * sizes["f16"]


async def _put_refused(dst: Any, blob: bytes, want: str) -> None:
    """STATE_PUT over RPC, an HTTP upload and a DECODE of ``blob`` are all refused with
    CAP_MISMATCH naming ``want``, and the target slot still holds what it held."""
    c = await rpc(dst)
    async with c:
        await prefill(c, 1, [{"role": "user", "content": "something else entirely"}])
        before = await slot_tokens(c, 1)
        r: RpcResponse = await c.call(state_put_call(1, blob), check=False)
        assert r.status == Status.ERROR and r.meta["error_code"] == "CAP_MISMATCH", r.meta
        assert want in r.meta["error"]
        assert await slot_tokens(c, 1) == before
    async with http(dst) as h:
        up = await h.put("/slots/1/state", content=blob)
        assert up.status_code == 409, up.text
        assert want in up.json()["error"]["message"]


@pytest.mark.parametrize(
    ("src", "dst", "want"),
    [
        ({"cache_type_k": "q8_0"}, {}, "K/V cache types q8_0/f16, here f16/f16"),
        ({"cache_type_v": "f32"}, {}, "K/V cache types f16/f32, here f16/f16"),
        ({"flash_attn": "on"}, {"flash_attn": "off"}, "V rows not transposed"),
    ],
    ids=["type_k", "type_v", "v_trans"],
)
async def test_kv_of_another_layout_is_refused_before_the_slot_is_touched(
    start_engine: Callable[..., Any], tiny_model_hd32: Path, src: dict[str, Any], dst: dict[str, Any], want: str
) -> None:
    a = await start_engine(tiny_model_hd32, **{"flash_attn": "on", **src})
    b = await start_engine(tiny_model_hd32, **{"flash_attn": "on", **dst})
    c = await rpc(a)
    async with c:
        pre = await prefill(c, 0, MESSAGES)
    await _put_refused(b, bytes(pre.payload), want)
    d = await rpc(b)
    async with d:
        before = await slot_tokens(d, 0)
        r = await decode(d, 0, frame(MESSAGES, pre.payload, n_predict=N, kv_metadata=kv_meta(pre)))
        assert r.status == Status.ERROR and r.meta["error_code"] == "CAP_MISMATCH", r.meta
        assert await slot_tokens(d, 0) == before


async def test_a_hand_off_in_another_layout_opens_no_connection(
    start_engine: Callable[..., Any], tiny_model_hd32: Path
) -> None:
    """The export's kv_transfer_params say its layout: a decode engine of another one falls
    back to a local prefill with reason layout_mismatch, and the export is never pulled."""
    p = await start_engine(tiny_model_hd32, cache_type_k="q8_0", flash_attn="on")
    d = await start_engine(tiny_model_hd32, flash_attn="on")
    req = {"messages": MESSAGES, "max_tokens": N, "temperature": 0}
    async with http(p) as hp:
        first = (await hp.post("/v1/chat/completions", json={**req, "max_tokens": 1, "kv_transfer_params": PD})).json()
    params = first["kv_transfer_params"]
    assert params["hydra"]["kv_cache"] == {"type_k": "q8_0", "type_v": "f16", "v_trans": False}
    async with http(d) as hd:
        body = (await hd.post("/v1/chat/completions", json={**req, "kv_transfer_params": params})).json()
    assert body["kv_transfer"]["status"] == "fallback" and body["kv_transfer"]["reason"] == "layout_mismatch"
    assert len(p.state.exports) == 1  # never pulled


async def test_a_q8_0_hand_off_gives_a_q8_0_engine_s_own_text(
    start_engine: Callable[..., Any], tiny_model_hd32: Path
) -> None:
    """Prefill on one q8_0 engine, decode on another: the same greedy text as one q8_0
    engine alone (the same shapes: the whole prompt in one evaluation, then steps)."""
    kw = {"cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"}
    p, d, alone = [await start_engine(tiny_model_hd32, **kw) for _ in range(3)]
    req = {"messages": MESSAGES, "max_tokens": N, "temperature": 0}
    async with http(alone) as h:
        want = (await h.post("/v1/chat/completions", json=req)).json()["choices"][0]["message"]["content"]
    async with http(p) as hp:
        params = (
            await hp.post("/v1/chat/completions", json={**req, "max_tokens": 1, "kv_transfer_params": PD})
        ).json()["kv_transfer_params"]
    async with http(d) as hd:
        body = (await hd.post("/v1/chat/completions", json={**req, "kv_transfer_params": params})).json()
    assert body["kv_transfer"]["status"] == "restored", body["kv_transfer"]
    assert body["choices"][0]["message"]["content"] == want
