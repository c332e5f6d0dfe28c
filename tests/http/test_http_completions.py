"""POST /v1/completions on a live engine (context-sensitive tiny model): the same text as chat
for the same prompt tokens, streaming, token-array prompts, stop strings, and 400s."""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from helpers import (
    MESSAGES,
    OTHER_MESSAGES,
    assert_openai_error,
    gate,
    http,
    parse_sse,
    stream_then_hang_up,
    wait_slots_idle,
)


async def complete(c: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await c.post("/v1/completions", json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


async def stream_complete(c: httpx.AsyncClient, **body: Any) -> tuple[list[dict[str, Any]], bool]:
    async with c.stream(
        "POST", "/v1/completions", json={"temperature": 0, **body, "stream": True}
    ) as r:
        assert r.status_code == 200, (await r.aread()).decode()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in r.aiter_lines()]
    return parse_sse(lines)


def assert_text_completion(body: dict[str, Any], model: str) -> None:
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == model
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert isinstance(choice["text"], str)
    assert choice["finish_reason"] in ("stop", "length")
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


async def test_completion_matches_chat_on_the_same_prompt(ctx_engine: Any) -> None:
    """A chat request and a text completion of its rendered prompt are one generation path:
    same usage, same greedy text."""
    model = ctx_engine.state.engine.identity.model_alias
    async with http(ctx_engine) as c:
        for messages in (MESSAGES, OTHER_MESSAGES):
            r = await c.post("/apply-template", json={"messages": messages})
            assert r.status_code == 200, r.text
            prompt = r.json()["prompt"]
            chat = (
                await c.post(
                    "/v1/chat/completions",
                    json={"messages": messages, "max_tokens": 12, "temperature": 0},
                )
            ).json()
            text = await complete(c, prompt=prompt, max_tokens=12)
            assert_text_completion(text, model)
            assert text["choices"][0]["text"] == chat["choices"][0]["message"]["content"]
            assert text["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]
            assert text["usage"]["completion_tokens"] == chat["usage"]["completion_tokens"] > 0
            assert text["choices"][0]["finish_reason"] == chat["choices"][0]["finish_reason"]


async def test_stream_token_array_and_stop(ctx_engine: Any) -> None:
    model = ctx_engine.state.engine.identity.model_alias
    prompt = "the slot cache engine"
    async with http(ctx_engine) as c:
        whole = await complete(c, prompt=prompt, max_tokens=10)
        text = whole["choices"][0]["text"]
        assert text

        events, done = await stream_complete(c, prompt=prompt, max_tokens=10)
        assert done
        assert all(e["object"] == "text_completion" and e["id"] == events[0]["id"] for e in events)
        assert "".join(e["choices"][0]["text"] for e in events) == text
        last = events[-1]
        assert last["choices"][0]["finish_reason"] == "length"
        assert last["usage"] == {
            **whole["usage"],
            "prompt_tokens_details": last["usage"]["prompt_tokens_details"],
        }
        assert_text_completion(last, model)
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])

        # The same prompt as token ids (with BOS, as a string prompt gets it).
        toks = (await c.post("/tokenize", json={"content": prompt, "add_special": True})).json()[
            "tokens"
        ]
        for form in (toks, [toks]):
            by_ids = await complete(c, prompt=form, max_tokens=10)
            assert by_ids["choices"][0]["text"] == text
            assert by_ids["usage"]["prompt_tokens"] == len(toks)

        # A stop string cuts the text before it and reports "stop".
        stop = text[len(text) // 2 :].strip()[:4]
        if stop:
            cut = await complete(c, prompt=prompt, max_tokens=10, stop=[stop])
            assert cut["choices"][0]["finish_reason"] == "stop"
            assert cut["choices"][0]["text"] == text[: text.index(stop)]


async def test_completions_share_batches_with_chat(ctx_engine: Any) -> None:
    """A completion and a chat generating at once are batched into the same llama_decode
    steps (the engine counts sequences per step)."""
    engine = ctx_engine.state.engine
    before_batches, before_tokens = engine._core.batcher.batches, engine._core.batcher.tokens
    async with http(ctx_engine) as c, gate(ctx_engine) as g, trio.open_nursery() as n:
        n.start_soon(partial(complete, c, prompt="tell me a story", max_tokens=24))
        n.start_soon(
            partial(
                c.post,
                "/v1/chat/completions",
                json={"messages": MESSAGES, "max_tokens": 24, "temperature": 0},
            )
        )
        # Both have asked the worker to tokenize: from here on their calls are FIFO, so the
        # second prefill runs while the first request still has ~23 steps to go.
        await g.wait_queued(2)
        g.open()
    steps = engine._core.batcher.batches - before_batches
    assert engine._core.batcher.tokens - before_tokens > steps, "no step carried both requests"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "prompt is required"),
        ({"prompt": []}, "prompt must be"),
        ({"prompt": {"text": "x"}}, "prompt must be"),
        ({"prompt": [1, "a"]}, "prompt must be"),
        ({"prompt": [10**9]}, "outside the vocabulary"),
        ({"prompt": ["a", "b"]}, "one prompt per request"),
        ({"prompt": "x", "n": 2}, "n must be 1"),
        ({"prompt": "x", "echo": "yes"}, "echo must be a boolean"),
        ({"prompt": "x", "logprobs": 21}, "logprobs must be an integer between 0 and 20"),
        ({"prompt": "x", "suffix": "end"}, "suffix is not supported"),
        ({"prompt": "x", "best_of": 2}, "best_of must be 1"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
    ],
)
async def test_bad_completion_requests_are_openai_400s(
    engine: Any, body: dict[str, Any], needle: str
) -> None:
    async with http(engine) as c:
        r = await c.post("/v1/completions", json=body)
        err = assert_openai_error(r, 400)
        assert needle in err["error"]["message"], err


async def test_client_disconnect_stops_a_completion_stream(engine: Any) -> None:
    """A client that leaves a text-completion stream stops its generation, as for chat."""
    eng = engine.state.engine
    async with http(engine) as c:
        # Baseline: this prompt really runs to 1000 tokens when nobody hangs up.
        full = await complete(c, prompt="hello world", max_tokens=1000)
        assert full["usage"]["completion_tokens"] == 1000
        before = eng._core.tokens_generated
        await stream_then_hang_up(c, "/v1/completions", {"prompt": "hello world", "max_tokens": 1000}, 3)
    await wait_slots_idle(eng)
    generated = eng._core.tokens_generated - before
    with trio.fail_after(5):
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
    assert eng._core.tokens_generated - before == generated, (
        "generation went on after the slot was released"
    )
    assert 3 <= generated < 500, f"{generated} tokens generated for a client that left after 3"


async def test_stream_interval_sends_the_first_token_alone_then_up_to_n(ctx_engine: Any) -> None:
    """vLLM's --stream-interval semantics, per request: the first token's chunk at once, then
    up to N tokens a chunk, the same text as without it."""
    async with http(ctx_engine) as c:
        plain = await complete(c, prompt="the slot", max_tokens=13, ignore_eos=True)
        texts = {}
        for interval in (1, 4):
            events, done = await stream_complete(
                c, prompt="the slot", max_tokens=13, ignore_eos=True, stream_interval=interval
            )
            assert done
            texts[interval] = [e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["text"]]
        assert "".join(texts[1]) == "".join(texts[4]) == plain["choices"][0]["text"]
        assert plain["usage"]["completion_tokens"] == 13
        # Every token's text is its own chunk at 1 (13 at most: a token may end mid-character);
        # at 4: the first token, then 12 tokens in chunks of 4.
        assert 4 < len(texts[1]) <= 13
        assert len(texts[4]) <= 4 and len(texts[4]) < len(texts[1])
        for bad in (0, "2", 5000):
            r = await c.post("/v1/completions", json={"prompt": "x", "stream": True, "stream_interval": bad})
            assert_openai_error(r, 400)
        r = await c.post("/v1/completions", json={"prompt": "x", "ignore_eos": "yes"})
        assert_openai_error(r, 400)
