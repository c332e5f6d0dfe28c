"""Chunked prefill inside the step batches: while streams generate, an arriving prompt is
evaluated a token budget's worth per batch, together with the streams' next tokens, and the
greedy text of every request is the same as when it runs alone."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trio.testing

from helpers import (
    LONG_TURN,
    MESSAGES,
    chat_completion,
    decode_ok,
    entry_of,
    frame,
    gate,
    get_result,
    http,
    rpc,
    slot_meta,
    text_of,
)

LONG_PROMPT = [*MESSAGES, LONG_TURN]  # ~1370 tokens
A_TOKENS = 200


async def erase_all(h: Any) -> None:
    for slot in (0, 1):
        assert (await h.post(f"/slots/{slot}?action=erase")).status_code == 200


async def test_a_prompt_arriving_during_generation_rides_in_the_step_batches(
    start_engine: Callable[..., Any], tiny_model_ctx: Path
) -> None:
    # batch_size = the step budget: a part that finds no step to share with is no larger.
    ep = await start_engine(tiny_model_ctx, ctx_size=4096, batch_size=32, step_token_budget=32)
    engine = ep.state.engine
    budget = engine._core.batcher.token_budget
    async with http(ep) as h, await rpc(ep) as c:
        alone_a = text_of(await chat_completion(h, MESSAGES, A_TOKENS))
        await erase_all(h)
        alone_b = await chat_completion(h, LONG_PROMPT, 8)
        await erase_all(h)
        prompt_b = alone_b["usage"]["prompt_tokens"]
        assert prompt_b > 10 * budget  # spread over many batches
        async with trio.open_nursery() as nursery, gate(ep) as g:
            rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=A_TOKENS))
            await g.step(2)  # tokenize, prefill: A samples its first token
            await g.wait_queued(1)  # A's next step waits for the worker: A is generating
            assert engine._core.batcher.generating == 1
            fused_before, parts_before = engine._core.batcher.prompt_tokens, engine._core.batcher.prompt_parts
            got: dict[str, Any] = {}

            async def request_b() -> None:
                got["b"] = await chat_completion(h, LONG_PROMPT, 8)

            nursery.start_soon(request_b)
            g.open()
        body_a = await get_result(h, rid)
    assert text_of(body_a) == alone_a
    assert text_of(got["b"]) == text_of(alone_b)
    assert got["b"]["usage"] == alone_b["usage"]
    # B's whole prompt went through step batches, a budget's worth (or less) at a time.
    assert engine._core.batcher.prompt_tokens - fused_before == prompt_b
    assert engine._core.batcher.prompt_parts - parts_before >= math.ceil(prompt_b / budget)


async def test_delete_while_the_prompt_rides_in_step_batches(
    start_engine: Callable[..., Any], tiny_model_ctx: Path
) -> None:
    """A DECODE whose prompt is being evaluated inside the step batches stops after the batch
    in flight: nothing is evaluated for it after the DELETE reply, and its slot is free."""
    ep = await start_engine(tiny_model_ctx, ctx_size=4096)
    engine = ep.state.engine
    async with http(ep) as h, await rpc(ep) as c:
        async with gate(ep) as g:
            a = await decode_ok(c, 0, frame(MESSAGES, n_predict=A_TOKENS))
            await g.step(2)  # A generates
            await g.wait_queued(1)
            b = await decode_ok(c, 1, frame(LONG_PROMPT, n_predict=8))
            await g.step(1)  # B's tokenize
            await g.step(3)  # three batches: A's steps with parts of B's prompt
            entry_b = entry_of(ep, b)
            fused = engine._core.batcher.prompt_tokens
            assert 0 < fused < len(LONG_TURN["content"]) and entry_b.result.completion_tokens == 0
            async with trio.open_nursery() as nursery:
                deleted: dict[str, Any] = {}

                async def delete_b() -> None:
                    deleted["r"] = await h.delete(f"/v1/decode/{b}")

                nursery.start_soon(delete_b)
                await trio.testing.wait_all_tasks_blocked()
                g.open()
            after_reply = engine._core.batcher.prompt_tokens
            assert deleted["r"].status_code == 200 and deleted["r"].json()["state"] == "cancelled"
        await get_result(h, a)  # A ran to its end: plenty of batches after the DELETE
        assert engine._core.batcher.prompt_tokens == after_reply
        assert (await slot_meta(c, 1))["is_processing"] is False
