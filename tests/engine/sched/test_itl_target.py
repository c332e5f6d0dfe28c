"""Prefill beside streams by an inter-token latency target (engine/sched/chunks.py): each
step carries as many prompt tokens as keep it under ``--itl-target-ms`` (by default the larger
of 20 one-stream steps and a step with an efficient part, as measured), from the step times the
batcher measures."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from helpers import LONG_TURN, MESSAGES, chat_completion, decode_ok, frame, gate, http, rpc, scrape, text_of
from hydra_trio.engine.sched.chunks import AUTO_STEPS, EFFICIENT_CHUNK, ChunkSizer

LONG_PROMPT = [*MESSAGES, LONG_TURN]  # ~1370 tokens


def test_before_any_measurement_a_step_carries_the_token_budget() -> None:
    sizer = ChunkSizer(0.0, budget=32, n_batch=512)
    assert sizer.target_s is None and sizer.step_s(1) is None
    assert sizer.chunk(1) == 31 and sizer.chunk(8) == 24 and sizer.chunk(40) == 8  # a quarter at least


def test_the_default_target_is_twenty_one_stream_steps() -> None:
    sizer = ChunkSizer(0.0, budget=32, n_batch=512)
    sizer.steps_ran(1, 0.010)
    assert sizer.target_s == pytest.approx(AUTO_STEPS * 0.010)
    sizer.prompt_ran(1, 32, 0.010 + 32 * 0.001)  # 1 ms a prompt token beside the stream
    # (0.9 x 200 ms - 10 ms) / 1 ms a token
    assert sizer.chunk(1) == 170


def test_the_default_target_grows_to_an_efficient_part_when_tokens_are_dear() -> None:
    """A CPU deep in a long prompt: 14 ms a prompt token, 24 ms a one-stream step. Twenty
    steps (480 ms) would hold ~29 tokens, a size that costs ~1.5x a token of a full batch;
    the default target is instead the step of an efficient part, and the part that size."""
    sizer = ChunkSizer(0.0, budget=32, n_batch=512)
    sizer.steps_ran(1, 0.024)
    sizer.prompt_ran(1, 32, 0.024 + 32 * 0.014)
    assert sizer.target_s == pytest.approx((0.024 + EFFICIENT_CHUNK * 0.014) / 0.9)
    assert sizer.target_s > AUTO_STEPS * 0.024
    assert sizer.chunk(1) == EFFICIENT_CHUNK
    assert sizer.report().part_floor_tokens == EFFICIENT_CHUNK


def test_under_the_default_target_a_part_is_never_below_the_efficient_size() -> None:
    """Beside many streams whose own step is over the target, the part is still efficient,
    but never more than the batch has room for beside the streams."""
    sizer = ChunkSizer(0.0, budget=32, n_batch=512)
    sizer.steps_ran(1, 0.010)
    sizer.steps_ran(64, 0.500)  # over 20 one-stream steps already
    sizer.prompt_ran(64, 32, 0.500 + 32 * 0.001)
    assert sizer.chunk(64) == EFFICIENT_CHUNK
    sizer.steps_ran(480, 0.900)
    assert sizer.chunk(480) == 32  # 512 cells of batch, 480 of them the streams'


def test_a_given_target_sizes_the_part_and_the_batch_bounds_it() -> None:
    sizer = ChunkSizer(0.050, budget=32, n_batch=512)
    sizer.steps_ran(1, 0.010)
    sizer.prompt_ran(1, 10, 0.010 + 10 * 0.001)
    assert sizer.target_s == 0.050
    assert sizer.chunk(1) == 35  # (45 ms - 10 ms) / 1 ms
    sizer.prompt_ran(1, 10, 0.010 + 10 * 0.00001)  # cheap tokens: half-way there at once
    assert sizer.chunk(1) == int((0.045 - 0.010) / ((0.001 + 0.00001) / 2))
    sizer.prompt_ran(1, 10, 0.010)  # nothing beyond the stream's step: the whole batch
    sizer.prompt_ran(1, 10, 0.010)
    sizer.prompt_ran(1, 10, 0.010)
    assert sizer.chunk(1) == 511


def test_a_step_over_the_target_leaves_the_floor() -> None:
    sizer = ChunkSizer(0.005, budget=32, n_batch=512)
    sizer.steps_ran(4, 0.020)
    sizer.prompt_ran(4, 8, 0.028)
    assert sizer.chunk(4) == 8  # a quarter of the budget: the prompt still progresses
    assert sizer.part_floor == 8  # a given target is kept: no efficient-size floor


def test_an_unmeasured_stream_count_is_priced_as_the_nearest() -> None:
    sizer = ChunkSizer(0.1, budget=32, n_batch=512)
    sizer.steps_ran(2, 0.02)
    sizer.steps_ran(8, 0.05)
    assert sizer.step_s(3) == 0.02 and sizer.step_s(6) == 0.05 and sizer.step_s(5) == 0.05
    assert sizer.target_s == 0.1


@pytest.mark.slow
@pytest.mark.parametrize(("target_ms", "few_parts"), [(600_000.0, True), (0.001, False)], ids=["long", "short"])
async def test_the_target_decides_the_parts_of_a_prompt_beside_a_stream(
    start_engine: Callable[..., Any], tiny_model_ctx: Path, target_ms: float, few_parts: bool
) -> None:
    """A stream generates; a long prompt arrives. With a target far above any step, the
    prompt goes in whole batches once the costs are measured (the first part is the token
    budget's); with one below any step, in parts of a quarter budget. The text is the same
    as alone either way. /metrics says the target in force and what it was sized from."""
    ep = await start_engine(
        tiny_model_ctx, ctx_size=8192, batch_size=512, step_token_budget=32, itl_target_ms=target_ms
    )
    batcher = ep.state.engine._core.batcher
    async with http(ep) as h, await rpc(ep) as c:
        alone_b = await chat_completion(h, LONG_PROMPT, 8)
        for slot in (0, 1):
            assert (await h.post(f"/slots/{slot}?action=erase")).status_code == 200
        n_prompt = alone_b["usage"]["prompt_tokens"]
        async with trio.open_nursery() as nursery, gate(ep) as g:
            rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=1000, ignore_eos=True))
            await g.step(2)  # tokenize, prefill: the stream samples its first token
            await g.wait_queued(1)
            parts_before = batcher.prompt_parts
            got: dict[str, Any] = {}

            async def request_b() -> None:
                got["b"] = await chat_completion(h, LONG_PROMPT, 8)

            nursery.start_soon(request_b)
            g.open()
        assert (await h.delete(f"/v1/decode/{rid}")).status_code == 200  # the stream outlived the prompt
        figures = await scrape(h)
    parts = batcher.prompt_parts - parts_before
    assert figures[("hydra_itl_target_seconds", ())] == pytest.approx(target_ms / 1000)
    assert figures[("hydra_prompt_part_floor_tokens", ())] == 8  # a given target: a quarter of the budget
    assert figures[("hydra_one_stream_step_seconds", ())] > 0
    assert figures[("hydra_prompt_token_seconds", ())] >= 0
    assert text_of(got["b"]) == text_of(alone_b)
    if few_parts:
        assert parts <= 1 + math.ceil((n_prompt - 31) / 511), parts
    else:
        assert parts >= 1 + math.ceil((n_prompt - 31) / 8), parts
