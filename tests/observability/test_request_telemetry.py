"""Every HTTP generation leaves a log line and vLLM's latency metrics, however it ends."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio

from helpers import MESSAGES, http, scrape, stream_then_hang_up, wait_slots_idle
from hydra_trio.concurrency import WriterTurn, start_owned
from hydra_trio.http.generation import Delta, GenerationStream


async def test_a_completion_leaves_a_log_line_metrics_and_its_request_id(
    engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hydra_trio")
    model = engine.state.engine.identity.model_alias
    labels = (("engine", "0"), ("model_name", model))
    async with http(engine) as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
            headers={"X-Request-Id": "router-42"},
        )
        assert r.status_code == 200 and r.headers["X-Request-Id"] == "router-42"
        m = await scrape(c)
    lines = [rec.getMessage() for rec in caplog.records if "X-Request-Id router-42" in rec.getMessage()]
    assert any("chat http:chatcmpl-" in line and " done: " in line and "6 generated" in line for line in lines), lines
    assert m[("vllm:request_success_total", tuple(sorted((*labels, ("finished_reason", "length")))))] == 1
    assert m[("vllm:generation_tokens_total", labels)] == 6
    assert m[("vllm:prompt_tokens_total", labels)] > 0
    assert m[("vllm:time_to_first_token_seconds_count", labels)] == 1
    assert m[("vllm:e2e_request_latency_seconds_count", labels)] == 1
    assert m[("vllm:inter_token_latency_seconds_count", labels)] == 5  # gaps between 6 tokens
    assert m[("vllm:inter_token_latency_seconds_bucket", tuple(sorted((*labels, ("le", "+Inf")))))] == 5


async def test_a_client_that_leaves_a_stream_is_logged_as_cancelled(
    engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hydra_trio")
    async with http(engine) as c:
        body = {"messages": MESSAGES, "max_tokens": 400, "ignore_eos": True, "stream": True}
        await stream_then_hang_up(c, "/v1/chat/completions", body, after=3)
        await wait_slots_idle(engine.state.engine)
    assert any(" cancelled: " in rec.getMessage() for rec in caplog.records), [r.getMessage() for r in caplog.records]


class _WakesProducerAsItCloses:
    """A stream's channel whose closing wakes the producer (as a step's token would): the
    moment of the race, made to happen every time."""

    def __init__(self, recv: trio.MemoryReceiveChannel[tuple[str, Any]], token_ready: trio.Event) -> None:
        self.recv = recv
        self.token_ready = token_ready

    async def aclose(self) -> None:
        self.recv.close()
        self.token_ready.set()
        await trio.lowlevel.checkpoint()


async def test_closing_a_stream_cancels_its_producer_before_closing_its_channel() -> None:
    """The client-gone race behind a 'failed: BrokenResourceError' line: a producer woken
    while the reader closes the stream must be cancelled, never find the channel closed."""
    send, recv = trio.open_memory_channel[Delta](1)
    token_ready = trio.Event()
    ended_by: list[type[BaseException]] = []

    async def produce(task_status: trio.TaskStatus[int]) -> None:
        task_status.started(0)
        try:
            await token_ready.wait()
            send.send_nowait(Delta("x"))
        except BaseException as exc:
            ended_by.append(type(exc))
            raise

    async with trio.open_nursery() as nursery:
        task, _ = await start_owned(nursery, "producer", produce)
        stream = GenerationStream(task, 0, _WakesProducerAsItCloses(recv, token_ready), WriterTurn())  # type: ignore[arg-type]
        await stream.close()
    assert ended_by == [trio.Cancelled]
