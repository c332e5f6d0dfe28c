"""OpenAI-compatible HTTP API of a live engine (tiny model): chat completions streaming and
not, determinism across calls and restarts, errors, status endpoints, metrics, client
disconnects and slot exhaustion."""

from __future__ import annotations

import json
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
    assert_openai_error,
    assert_server_healthy,
    chat,
    http,
    metric_samples,
    sse_chunk,
    sse_text,
    stream_chat,
    stream_then_hang_up,
    wait_slots_idle,
)


def assert_completion_shape(body: dict[str, Any], *, model: str = "tiny") -> None:
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert isinstance(body["created"], int)
    assert body["model"] == model
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    u = body["usage"]
    assert u["prompt_tokens"] > 0
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert 0 <= u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"]
    t = body["timings"]
    assert t["predicted_n"] == u["completion_tokens"]
    assert t["cache_n"] + t["prompt_n"] == u["prompt_tokens"]
    assert isinstance(body["id_slot"], int)


@pytest.fixture
async def engine(start_engine: Callable[..., Any], tiny_model: Path) -> Any:
    """The shared fixture's engine, single-threaded (see helpers.ENGINE)."""
    return await start_engine(tiny_model, **ENGINE)


# ---- determinism ----------------------------------------------------------------------------


async def _texts(ep: Any) -> list[str]:
    async with http(ep) as c:
        out = []
        for messages in (MESSAGES, OTHER_MESSAGES, MESSAGES):
            body = await chat(c, messages=messages, max_tokens=32)
            assert body["usage"]["completion_tokens"] > 0
            out.append(body["choices"][0]["message"]["content"])
        chunks, done, _ = await stream_chat(c, messages=OTHER_MESSAGES, max_tokens=32)
        assert done
        out.append(sse_text(chunks))
        return out


async def test_greedy_identical_across_calls_and_restarts(run_engine: Callable[..., Any], tiny_model_ctx: Path) -> None:
    async with run_engine(tiny_model_ctx) as ep:
        first = await _texts(ep)
    async with run_engine(tiny_model_ctx) as ep:  # a fresh process-level engine: new context, new KV
        second = await _texts(ep)
    assert first == second
    assert first[0] == first[2]  # same prompt again (now from the slot's cached prefix)
    assert first[1] == first[3]  # stream == non-stream
    assert first[0] != first[1]  # different prompts really give different text
    assert all(first)


async def test_concurrent_requests_match_sequential(ctx_engine: Any) -> None:
    """Two requests generating at once (batched steps) give the same text as alone."""
    engine = ctx_engine
    async with http(engine) as c:
        alone = [
            (await chat(c, messages=m, max_tokens=48))["choices"][0]["message"]["content"]
            for m in (MESSAGES, OTHER_MESSAGES)
        ]
        together: list[str] = ["", ""]

        async def one(i: int, messages: list[dict[str, str]]) -> None:
            body = await chat(c, messages=messages, max_tokens=48)
            together[i] = body["choices"][0]["message"]["content"]

        async with trio.open_nursery() as n:
            n.start_soon(one, 0, MESSAGES)
            n.start_soon(one, 1, OTHER_MESSAGES)
    assert together == alone


# ---- shapes ---------------------------------------------------------------------------------


async def test_non_streaming_completion_shape(engine: Any) -> None:
    async with http(engine) as c:
        body = await chat(c, max_tokens=12)
        assert_completion_shape(body)
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 12
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # Same prompt again: the slot's KV prefix is reused, all but the last prompt token
        # (evaluated alone for its logits). A batch of one rounds differently from the whole
        # prompt's, so the text to compare with is the next run of that same computation.
        again = [await chat(c, max_tokens=12) for _ in range(2)]
        for res in again:
            assert_completion_shape(res)
            assert res["id"] != body["id"]
            assert res["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"]
            assert res["usage"]["prompt_tokens_details"]["cached_tokens"] == body["usage"]["prompt_tokens"] - 1
            assert res["id_slot"] == body["id_slot"]
        assert again[0]["choices"][0]["message"]["content"] == again[1]["choices"][0]["message"]["content"]


async def test_streaming_matches_non_streaming(ctx_engine: Any) -> None:
    async with http(ctx_engine) as c:
        plain = await chat(c, messages=OTHER_MESSAGES, max_tokens=40)
        chunks, done, resp = await stream_chat(c, messages=OTHER_MESSAGES, max_tokens=40)
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert done, "stream must end with data: [DONE]"
    assert len(chunks) >= 3
    ids = {ch["id"] for ch in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    for ch in chunks:
        assert ch["object"] == "chat.completion.chunk"
        assert ch["model"] == plain["model"] == "tiny-ctx"
        assert isinstance(ch["created"], int)
        assert len(ch["choices"]) == 1 and ch["choices"][0]["index"] == 0
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for ch in chunks[:-1]:
        assert ch["choices"][0]["finish_reason"] is None
        assert "usage" not in ch
    last = chunks[-1]
    assert last["choices"][0]["delta"] == {}
    assert last["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert last["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] > 0
    assert last["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]
    assert "timings" in last and isinstance(last["id_slot"], int)
    assert sse_text(chunks) == plain["choices"][0]["message"]["content"]
    assert sse_text(chunks)


async def test_stop_strings(engine: Any) -> None:
    async with http(engine) as c:
        full = (await chat(c, max_tokens=40))["choices"][0]["message"]["content"]
        assert len(full) >= 8
        stop = full[3:6]  # a stop string that likely spans tokens
        cut = full[: full.find(stop)]
        body = await chat(c, max_tokens=40, stop=stop)
        assert body["choices"][0]["message"]["content"] == cut
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] < 40
        chunks, done, _ = await stream_chat(c, max_tokens=40, stop=[stop, "\x00never"])
        assert done
        assert sse_text(chunks) == cut
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        # A stop string that never appears changes nothing.
        body = await chat(c, max_tokens=40, stop=["\x00never"])
        assert body["choices"][0]["message"]["content"] == full
        assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens", "n_predict"])
async def test_max_tokens(engine: Any, key: str) -> None:
    async with http(engine) as c:
        long = await chat(c, max_tokens=30)
        short = await chat(c, **{key: 7})
    assert short["usage"]["completion_tokens"] == 7
    assert short["choices"][0]["finish_reason"] == "length"
    assert long["choices"][0]["message"]["content"].startswith(short["choices"][0]["message"]["content"])


async def test_default_max_tokens(engine: Any) -> None:
    async with http(engine) as c:
        body = await chat(c)
    assert body["usage"]["completion_tokens"] == engine.state.settings.default_n_predict


# ---- errors ---------------------------------------------------------------------------------

BAD_BODIES: dict[str, bytes] = {
    "not-json": b"{not json",
    "not-utf8": b"\xff\xfe{}",
    "array": b"[1, 2]",
    "empty": b"",
    "no-messages": json.dumps({"max_tokens": 4}).encode(),
    "empty-messages": json.dumps({"messages": []}).encode(),
    "bad-role": json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(),
    "bad-content": json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(),
    "image-part": json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    ).encode(),
    "temperature-str": json.dumps({"messages": MESSAGES, "temperature": "hot"}).encode(),
    "temperature-neg": json.dumps({"messages": MESSAGES, "temperature": -1}).encode(),
    "top-p-over-1": json.dumps({"messages": MESSAGES, "top_p": 2.0}).encode(),
    "max-tokens-str": json.dumps({"messages": MESSAGES, "max_tokens": "ten"}).encode(),
    "max-tokens-float": json.dumps({"messages": MESSAGES, "max_tokens": 1.5}).encode(),
    "stream-str": json.dumps({"messages": MESSAGES, "stream": "yes"}).encode(),
    "stop-int": json.dumps({"messages": MESSAGES, "stop": 5}).encode(),
    "too-many-stops": json.dumps({"messages": MESSAGES, "stop": [str(i) for i in range(17)]}).encode(),
    "sampling-not-object": json.dumps({"messages": MESSAGES, "sampling": 3}).encode(),
    "tools-not-array": json.dumps({"messages": MESSAGES, "tools": {}}).encode(),
}


async def test_bad_requests_get_400_with_openai_error(engine: Any) -> None:
    async with http(engine) as c:
        for name, raw in BAD_BODIES.items():
            r = await c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            body = assert_openai_error(r, 400)
            assert body["error"]["type"] == "invalid_request_error", name
        # The engine is fine afterwards and no slot was left claimed.
        assert (await chat(c, max_tokens=4))["usage"]["completion_tokens"] == 4
        slots = (await c.get("/slots")).json()
        assert not any(s["is_processing"] for s in slots)


async def test_prompt_longer_than_context_is_refused(engine: Any) -> None:
    async with http(engine) as c:
        huge = [{"role": "user", "content": "the " * 3000}]
        r = await c.post("/v1/chat/completions", json={"messages": huge, "max_tokens": 4})
        # OpenAI's 400 context_length_exceeded: what agents compact their conversation on.
        # (its code is OpenAI's string, not the HTTP status the other errors carry).
        assert r.status_code == 400, r.text
        body = r.json()
        assert body.get("error_code") == "TOO_LARGE" and body["error"]["code"] == "context_length_exceeded"
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"].startswith("prompt has")
        r = await c.post("/v1/chat/completions", json={"messages": huge, "max_tokens": 4, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


async def test_unknown_route_and_method(engine: Any) -> None:
    async with http(engine) as c:
        assert_openai_error(await c.get("/v1/nothing-here"), 404)
        r = await c.get("/v1/chat/completions")
        assert r.status_code == 405
        assert "error" in r.json()


# ---- status endpoints -----------------------------------------------------------------------


async def test_health_version_models_slots(engine: Any) -> None:
    async with http(engine) as c:
        r = await c.get("/health")
        assert r.status_code == 200
        health = r.json()
        assert health["status"] == "ok"
        assert health["slots_idle"] == 2 and health["slots_processing"] == 0

        r = await c.get("/version")
        assert r.status_code == 200
        v = r.json()
        assert v["engine"] == "hydra-trio" and v["version"] == hydra_trio.__version__

        r = await c.get("/v1/models")
        assert r.status_code == 200
        models = r.json()
        assert models["object"] == "list"
        (m,) = models["data"]
        assert m["id"] == "tiny" and m["object"] == "model"
        assert m["meta"]["n_ctx"] == 4096 and m["meta"]["n_vocab"] == 512
        assert m["meta"]["model_name"] == "Hydra Synthetic Tiny"

        r = await c.get("/slots")
        assert r.status_code == 200
        slots = r.json()
        assert [s["id"] for s in slots] == [0, 1]
        for s in slots:
            # a split cache: 4096 / 2 slots
            assert s["is_processing"] is False and s["n_past"] == 0 and s["n_ctx"] == 2048

        body = await chat(c, max_tokens=5)
        slots = (await c.get("/slots")).json()
        used = slots[body["id_slot"]]
        # n_past = prompt + generated tokens held in KV (the last sampled token is not evaluated).
        assert used["n_past"] == body["usage"]["prompt_tokens"] + 5 - 1
        assert used["state_size"] > slots[1 - body["id_slot"]]["state_size"]


async def test_metrics_after_completion(engine: Any) -> None:
    async with http(engine) as c:
        await chat(c, max_tokens=9)
        r = await c.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    samples = metric_samples(r.text)
    assert all(name.startswith(("hydra_", "vllm:", "python_", "process_")) for name, _ in samples)
    assert samples[("hydra_completion_tokens_total", (("path", "chat"),))] == 9
    assert samples[("hydra_prompt_tokens_total", (("path", "chat"),))] > 0
    assert samples[("hydra_ttft_seconds_count", (("path", "chat"),))] == 1
    assert samples[("hydra_http_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))] == 1
    assert samples[("hydra_slots_total", ())] == 2
    assert samples[("hydra_slots_busy", ())] == 0
    assert samples[("hydra_gpu_worker_calls_total", ())] > 0
    assert samples[("hydra_step_batches_total", ())] > 0
    assert samples[("hydra_kv_cells_used", ())] > 0
    assert samples[("hydra_model_load_seconds", ())] > 0


# ---- disconnects and busy slots -------------------------------------------------------------


async def test_client_disconnect_stops_generation(engine: Any) -> None:
    eng = engine.state.engine
    async with http(engine) as c:
        # Baseline: this prompt really runs to 1000 tokens when nobody hangs up.
        full = await chat(c, max_tokens=1000)
        assert full["usage"]["completion_tokens"] == 1000
        before = eng._core.tokens_generated

        await stream_then_hang_up(c, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1000}, 4)

    await wait_slots_idle(eng)
    generated = eng._core.tokens_generated - before
    with trio.fail_after(5):
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
    assert eng._core.tokens_generated - before == generated, "generation went on after the slot was released"
    assert 3 <= generated < 500, f"{generated} tokens generated for a client that left after 3"


async def test_all_slots_busy_gets_503(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, **ENGINE, slots=1, slot_wait_s=0.2, ctx_size=8192)
    async with http(ep) as c, http(ep) as c2:
        first_done = trio.Event()
        n_chunks = 0
        got_chunk = trio.Event()

        async def long_stream(cancel: trio.CancelScope) -> None:
            nonlocal n_chunks
            with cancel:
                async with c.stream(
                    "POST", "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8000, "stream": True}
                ) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if sse_chunk(line) is not None:
                            n_chunks += 1
                            if n_chunks >= 3:
                                got_chunk.set()
            first_done.set()

        async with trio.open_nursery() as n:
            scope = trio.CancelScope()
            n.start_soon(long_stream, scope)
            with trio.fail_after(10):
                await got_chunk.wait()
            r = await c2.post("/v1/chat/completions", json={"messages": OTHER_MESSAGES, "max_tokens": 4})
            assert not first_done.is_set(), "the long stream ended before the second request was refused"
            body = assert_openai_error(r, 503)
            assert body["error"]["type"] == "unavailable_error"
            assert r.headers.get("retry-after") == "1"
            r = await c2.post(
                "/v1/chat/completions", json={"messages": OTHER_MESSAGES, "max_tokens": 4, "stream": True}
            )
            assert_openai_error(r, 503)
            scope.cancel()  # hang up on the long stream
        await wait_slots_idle(ep.state.engine)
        # The slot is free again: the next request is served.
        assert (await chat(c2, messages=OTHER_MESSAGES, max_tokens=4))["usage"]["completion_tokens"] == 4


async def test_a_stream_that_fails_midway_ends_with_an_error_event(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Text went out, then generation failed (any exception, not only a ProtocolError): the
    client gets an error event naming the failure, never a clean-looking end."""
    eng = engine.state.engine
    real_generate = eng._core.generate

    async def generate_then_fail(slot: int, tokens: Any, params: Any, emit: Any, **kw: Any) -> Any:
        await emit("some text")
        raise RuntimeError("the GPU fell off the bus")

    monkeypatch.setattr(eng._core, "generate", generate_then_fail)
    async with http(engine) as c:
        body = {"messages": MESSAGES, "max_tokens": 8, "stream": True}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines()]
    events = [c for x in lines if (c := sse_chunk(x)) is not None]
    assert events[1]["choices"][0]["delta"] == {"content": "some text"}
    assert events[-1]["error"]["code"] == 500 and events[-1]["error_code"] == "INTERNAL", events[-1]
    assert "RuntimeError" in events[-1]["error"]["message"]
    monkeypatch.setattr(eng._core, "generate", real_generate)
    await assert_server_healthy(engine)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": "hi"}, "messages is required"),
        ({"messages": MESSAGES, "n": 2}, "n must be 1"),
        ({"messages": MESSAGES, "logprobs": "yes"}, "logprobs must be a boolean"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ({"messages": MESSAGES, "response_format": {"type": "regex"}}, "response_format type 'regex' is not supported"),
    ],
)
async def test_unsupported_chat_parameters_get_a_400_that_names_them(
    engine: Any, body: dict[str, Any], needle: str
) -> None:
    """Not a quiet different answer (a prompt-only body used to generate 512 tokens, n=2 one
    choice, logprobs None; test_http_logprobs.py has the whole policy)."""
    async with http(engine) as c:
        err = assert_openai_error(await c.post("/v1/chat/completions", json=body), 400)
        assert needle in err["error"]["message"], err
        ok = {"messages": MESSAGES, "max_tokens": 2, "n": 1, "logprobs": False, "response_format": {"type": "text"}}
        assert (await c.post("/v1/chat/completions", json=ok)).status_code == 200
