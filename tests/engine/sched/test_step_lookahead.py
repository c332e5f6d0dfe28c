"""Look-ahead steps: when a step samples a token the request will surely feed back (no end
of generation, within its token limit), the batcher starts that token's step at once,
before the request task has run. A request that stops for a reason only it knows (a stop
word, a DELETE) drops that step; the slot's KV and its token list stay in agreement."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp

import hydra_trio.engine.sched.batcher as batcher_module
from helpers import MESSAGES, chat_completion, http, text_of

N = 40


def kv_positions(engine: Any, slot: int) -> int:
    """Positions the slot holds in llama.cpp's KV cache (not our bookkeeping)."""
    return int(llama_cpp.llama_memory_seq_pos_max(engine._core.backend._mem, slot)) + 1


async def test_the_next_step_runs_in_the_same_worker_call(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model, slots=1)
    engine = ep.state.engine
    batcher = engine._core.batcher
    async with http(ep) as h:
        used, runs, tokens = batcher.ahead_used, batcher.runs, batcher.tokens
        body = await chat_completion(h, MESSAGES, N)
    n = body["usage"]["completion_tokens"]
    assert body["choices"][0]["finish_reason"] == "length" and n == N
    # Token 1 comes from the prefill, steps evaluate tokens 1..N-1. The request hands in the
    # first step; the worker goes on to the next without waiting for it (how far it gets
    # before a step ends ahead of the request depends on timing: at least that one).
    assert batcher.tokens - tokens == n - 1
    assert batcher.ahead_used - used >= 1
    assert batcher.runs - runs < n - 1


async def test_a_run_of_steps_returns_to_trio_after_its_limit(
    start_engine: Callable[..., Any], tiny_model: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(batcher_module, "MAX_STEPS_PER_CALL", 3)
    ep = await start_engine(tiny_model, slots=1)
    engine = ep.state.engine
    async with http(ep) as h:
        runs = engine._core.batcher.runs
        body = await chat_completion(h, MESSAGES, N)
    assert body["usage"]["completion_tokens"] == N  # nothing lost at the seams
    assert engine._core.batcher.runs - runs >= (N - 1) / 3


async def test_no_step_is_evaluated_past_the_token_limit(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model, slots=1)
    engine = ep.state.engine
    async with http(ep) as h:
        dropped = engine._core.batcher.ahead_dropped
        body = await chat_completion(h, MESSAGES, N)
    usage = body["usage"]
    # The last token is never evaluated: the slot holds the prompt and all tokens but it.
    assert engine._core.n_past(0) == kv_positions(engine, 0) == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert engine._core.batcher.ahead_dropped == dropped


async def test_a_stop_word_drops_the_step_and_leaves_a_consistent_slot(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model, slots=1)
    engine = ep.state.engine
    body = {"messages": MESSAGES, "max_tokens": N, "temperature": 0}
    async with http(ep) as h:
        # The reference is a second run: like every run after it, it finds all but the last
        # prompt token in the slot (the same computation, so the same text).
        await chat_completion(h, MESSAGES, N)
        full = text_of(await chat_completion(h, MESSAGES, N))
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        assert stop.strip(), full
        cut = full.index(stop)
        dropped = engine._core.batcher.ahead_dropped
        r = await h.post("/v1/chat/completions", json={**body, "stop": [stop]})
        assert r.status_code == 200, r.text
        stopped = r.json()
        assert text_of(stopped) == full[:cut]
        assert stopped["choices"][0]["finish_reason"] == "stop"
        # At most the one look-ahead step of the stopping token was dropped. Whether there was
        # one depends on timing: a request that lags (a busy machine) has not taken its last
        # look-ahead step when the next token is sampled, and that one gets none of its own.
        assert engine._core.batcher.ahead_dropped - dropped in (0, 1)
        # The dropped step either never ran or ran to its end: our token list and the KV
        # agree either way, and hold at most one token beyond what the request used.
        usage = stopped["usage"]
        held = engine._core.n_past(0)
        assert held == kv_positions(engine, 0)
        assert (
            usage["prompt_tokens"] + usage["completion_tokens"] - 1
            <= held
            <= usage["prompt_tokens"] + usage["completion_tokens"]
        )
        # The slot is reused from that state (common prefix) and still gives the same text.
        again = await chat_completion(h, MESSAGES, N)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
        assert text_of(again) == full
