"""OpenAI logprobs on chat and text completions (tiny context-sensitive model, greedy), and
the request-parameter policy of both routes (engine/requests.py): honoured, ignored, or
a 400 that names the parameter, in the one error shape."""

from __future__ import annotations

import math
from typing import Any

import httpx
import numpy as np
import pytest
import trio

from helpers import (
    MESSAGES,
    OTHER_MESSAGES,
    assert_openai_error,
    http,
    parse_sse,
    stream_chat,
    wait_slots_idle,
)
from hydra_trio.engine.requests import IGNORED
from hydra_trio.engine.sample import log_softmax, token_logprobs


async def _post(c: httpx.AsyncClient, path: str, **body: Any) -> dict[str, Any]:
    r = await c.post(path, json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


async def _stream(c: httpx.AsyncClient, path: str, **body: Any) -> list[dict[str, Any]]:
    async with c.stream("POST", path, json={"temperature": 0, **body, "stream": True}) as r:
        assert r.status_code == 200, (await r.aread()).decode()
        events, done = parse_sse([line async for line in r.aiter_lines()])
    assert done
    return events


def _same_chat(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """The same tokens with the same logprobs (up to float noise: a prompt served from a
    slot's cache has its last position evaluated alone, not in the prompt's batch)."""
    assert [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in a] == [
        (e["token"], [t["token"] for t in e["top_logprobs"]]) for e in b
    ]
    for x, y in zip(a, b, strict=True):
        assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)
        assert [t["logprob"] for t in x["top_logprobs"]] == pytest.approx(
            [t["logprob"] for t in y["top_logprobs"]], abs=1e-4
        )


def _check_top(top: list[tuple[float, Any]], n: int) -> None:
    assert len(top) == n
    values = [lp for lp, _ in top]
    assert all(lp <= 0.0 for lp in values)
    assert values == sorted(values, reverse=True)


async def test_chat_logprobs_are_the_greedy_distribution(ctx_engine: Any) -> None:
    async with http(ctx_engine) as c:
        body = await _post(
            c, "/v1/chat/completions", messages=OTHER_MESSAGES, max_tokens=12, logprobs=True, top_logprobs=5
        )
        plain = await _post(c, "/v1/chat/completions", messages=OTHER_MESSAGES, max_tokens=12)
    choice = body["choices"][0]
    assert "logprobs" not in plain["choices"][0]  # not asked: nothing computed, nothing said
    assert choice["message"]["content"] == plain["choices"][0]["message"]["content"]
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] > 0
    text = b""
    for entry in content:
        assert entry["logprob"] <= 0.0
        # bytes are exact; token is their text (a byte of a split character reads U+FFFD).
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        top = entry["top_logprobs"]
        _check_top([(t["logprob"], t) for t in top], 5)
        # Greedy: the sampled token is the most likely one, with the same log-probability.
        assert top[0]["token"] == entry["token"] and top[0]["logprob"] == entry["logprob"]
        assert top[0]["bytes"] == entry["bytes"]
        text += bytes(entry["bytes"])
    assert text.decode("utf-8", "replace") == choice["message"]["content"]


async def _erase_slots(c: httpx.AsyncClient, n_slots: int) -> None:
    for slot in range(n_slots):
        r = await c.post(f"/slots/{slot}?action=erase")
        assert r.status_code == 200, r.text


async def test_chat_logprobs_stream_like_the_whole_reply(start_engine: Any, tiny_model_ctx: Any) -> None:
    # Each request evaluates its whole prompt in one batch (slots erased between them, no
    # host cache): a prompt continued from a slot's cache has its last position evaluated
    # alone, which rounds differently (1.8e-3 in a logprob on AVX-512 EPYC).
    ep = await start_engine(tiny_model_ctx, threads=1, cache_ram_mib=0)
    ask = {"messages": MESSAGES, "max_tokens": 20, "logprobs": True, "top_logprobs": 3}
    async with http(ep) as c:
        whole = await _post(c, "/v1/chat/completions", **ask)
        await _erase_slots(c, 2)
        chunks, _done, _ = await stream_chat(c, temperature=0, **ask)
        await _erase_slots(c, 2)
        no_top = await _post(c, "/v1/chat/completions", messages=MESSAGES, max_tokens=20, logprobs=True)
    streamed = [e for ch in chunks for e in ((ch["choices"][0].get("logprobs") or {}).get("content") or [])]
    _same_chat(streamed, whole["choices"][0]["logprobs"]["content"])
    # Every text chunk carries its own tokens' logprobs.
    for ch in chunks[1:-1]:
        assert ch["choices"][0]["logprobs"]["content"], ch
    # top_logprobs 0 (the default): the sampled tokens' logprobs, no alternatives.
    bare = no_top["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in bare] == [e["token"] for e in streamed]
    assert [e["logprob"] for e in bare] == pytest.approx([e["logprob"] for e in streamed], abs=1e-4)
    assert all(e["top_logprobs"] == [] for e in bare)


async def test_logprobs_of_a_reply_cut_by_a_stop_string(ctx_engine: Any) -> None:
    """Tokens whose text a stop string swallowed still get their entries, streamed or not."""
    async with http(ctx_engine) as c:
        full = await _post(c, TEXT, prompt="the slot", max_tokens=24)
        text = full["choices"][0]["text"]
        stop = text[len(text) // 2 :][:3]
        ask = {"prompt": "the slot", "max_tokens": 24, "logprobs": 1, "stop": [stop]}
        whole = await _post(c, TEXT, **ask)
        events = await _stream(c, TEXT, **ask)
    assert whole["choices"][0]["finish_reason"] == "stop"
    n = whole["usage"]["completion_tokens"]
    assert len(whole["choices"][0]["logprobs"]["tokens"]) == n
    streamed = [t for ev in events if ev["choices"][0]["logprobs"] for t in ev["choices"][0]["logprobs"]["tokens"]]
    assert streamed == whole["choices"][0]["logprobs"]["tokens"]


async def test_logprobs_in_shared_batches_match_alone(start_engine: Any, tiny_model_ctx: Any) -> None:
    """Concurrent requests (one batch per step, look-ahead steps) keep each token's entry with
    its token: the same as each request alone, beside one that did not ask. Every prompt is
    evaluated whole (slots erased, no host cache): one continued from a slot's cache rounds
    differently."""
    ep = await start_engine(tiny_model_ctx, threads=1, cache_ram_mib=0, slots=3)
    asks = [
        {"messages": MESSAGES, "max_tokens": 16, "logprobs": True, "top_logprobs": 2},
        {"messages": OTHER_MESSAGES, "max_tokens": 16, "logprobs": True, "top_logprobs": 1},
        {"messages": OTHER_MESSAGES, "max_tokens": 16},
    ]
    async with http(ep) as c:
        alone = []
        for a in asks:
            alone.append(await _post(c, "/v1/chat/completions", **a))
            await _erase_slots(c, 3)
        together: list[dict[str, Any]] = [{}] * len(asks)

        async def one(i: int) -> None:
            together[i] = await _post(c, "/v1/chat/completions", **asks[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(asks)):
                nursery.start_soon(one, i)
    for a, b in zip(alone[:2], together[:2], strict=True):
        assert a["choices"][0]["message"] == b["choices"][0]["message"]
        _same_chat(a["choices"][0]["logprobs"]["content"], b["choices"][0]["logprobs"]["content"])
    assert "logprobs" not in together[2]["choices"][0]


async def test_completion_logprobs_match_a_direct_computation(ctx_engine: Any) -> None:
    engine = ctx_engine.state.engine
    prompt = "the slot cache"
    async with http(ctx_engine) as c:
        body = await _post(c, "/v1/completions", prompt=prompt, max_tokens=10, logprobs=4)
        events = await _stream(c, "/v1/completions", prompt=prompt, max_tokens=10, logprobs=4)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 10
    text = body["choices"][0]["text"]
    # Character offsets into the text (a token inside a split character: that character's).
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert lp["text_offset"][-1] < len(text)
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        assert value <= 0.0 and ranked[0] == (token, value)
        _check_top([(v, k) for k, v in ranked], len(top))
        assert 1 <= len(top) <= 5  # the 4 most likely and the sampled one (here among them)
    # Streaming: the same values, chunk by chunk, offsets counted on across chunks.
    merged: dict[str, list[Any]] = {k: [] for k in lp}
    for ev in events:
        chunk_lp = ev["choices"][0]["logprobs"]
        for k in merged:
            merged[k] += chunk_lp[k] if chunk_lp else []
    assert merged["tokens"] == lp["tokens"] and merged["text_offset"] == lp["text_offset"]
    assert merged["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    assert [sorted(d) for d in merged["top_logprobs"]] == [sorted(d) for d in lp["top_logprobs"]]

    # The same numbers straight from the model's logits after the prompt.
    await wait_slots_idle(engine)
    tokens = await engine._core.inputs.tokenize_text(prompt)
    slot = engine._core.slots.claim(1, "test:logprobs")
    try:
        _, raw = await engine._core.prefill(slot.id, tokens, 0, want_logits=True)
    finally:
        engine._core.slots.release(slot)
    assert raw is not None
    logits = np.frombuffer(raw, dtype="<f4")
    full = log_softmax(logits)
    assert math.isclose(float(np.exp(full).sum()), 1.0, rel_tol=1e-9)
    first = int(logits.argmax())
    direct = token_logprobs(logits, first, 4)
    assert direct.logprob == pytest.approx(lp["token_logprobs"][0], abs=1e-4)
    assert [v for _, v in direct.top] == pytest.approx(sorted(lp["top_logprobs"][0].values(), reverse=True), abs=1e-4)
    assert direct.logprob == pytest.approx(float(full[first])) and direct.logprob == max(v for _, v in direct.top)


def test_token_logprobs_rank_ties_by_token_id() -> None:
    """Equal logits rank by token id, so the top-1 is the token greedy sampling picks."""
    values = np.array([1.0, 3.0, 3.0, 0.0, 3.0, -np.inf], dtype=np.float32)
    assert [t for t, _ in token_logprobs(values, 1, 3).top] == [1, 2, 4]
    assert [t for t, _ in token_logprobs(values, 1, 2).top] == [1, 2]
    assert math.isclose(sum(math.exp(v) for _, v in token_logprobs(values, 0, 6).top), 1.0, rel_tol=1e-9)
    assert token_logprobs(values, 5, 0).top == () and token_logprobs(values, 5, 0).logprob == -math.inf


# ---- the parameter policy ----------------------------------------------------------------

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": MESSAGES, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
        (CHAT, {"messages": MESSAGES, "logprobs": 3}, "logprobs"),
        (CHAT, {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
        (CHAT, {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f g"}}]},
         "tools[0].function.name"),
        (CHAT, {"messages": MESSAGES, "logit_bias": {"5": 10}}, "logit_bias"),
        (CHAT, {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
        (CHAT, {"messages": MESSAGES, "audio": {"voice": "x"}}, "audio"),
        (CHAT, {"messages": MESSAGES, "modalities": ["text", "audio"]}, "modalities"),
        (CHAT, {"messages": MESSAGES, "prediction": {"type": "content", "content": "x"}}, "prediction"),
        (CHAT, {"messages": MESSAGES, "store": True}, "store"),
        (CHAT, {"messages": MESSAGES, "n": 2}, "n"),
        (CHAT, {"messages": MESSAGES, "stream_options": True}, "stream_options"),
        (CHAT, {"messages": MESSAGES, "grammar": "root ::= a"}, "grammar"),  # honoured; this one cannot compile
        (CHAT, {"messages": MESSAGES, "echo": True}, "echo"),
        (CHAT, {"prompt": "hi"}, "messages"),
        (CHAT, {"messages": MESSAGES, "prompt": "hi"}, "prompt"),
        (CHAT, {"messages": MESSAGES, "frequency_penalty": 3}, "frequency_penalty"),
        (TEXT, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (TEXT, {"prompt": "x", "logprobs": True}, "logprobs"),
        (TEXT, {"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
        (TEXT, {"prompt": "x", "messages": MESSAGES}, "messages"),
        (TEXT, {"messages": MESSAGES}, "messages"),
        (TEXT, {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "echo"),  # the prompt's come whole
        (TEXT, {"prompt": "x", "suffix": "end"}, "suffix"),
        (TEXT, {"prompt": "x", "best_of": 2}, "best_of"),
        (TEXT, {"prompt": "x", "logit_bias": {"5": 1}}, "logit_bias"),
        (TEXT, {"prompt": "x", "min_tokens": 4, "max_tokens": 2}, "min_tokens"),
    ],
)
async def test_what_is_not_honoured_is_a_400_naming_it(
    engine: Any, path: str, body: dict[str, Any], param: str
) -> None:
    async with http(engine) as c:
        err = assert_openai_error(await c.post(path, json=body), 400)["error"]
    assert err["param"] == param, err
    assert param in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}


async def test_ignored_and_neutral_parameters_are_accepted(engine: Any) -> None:
    values: dict[str, Any] = {
        "model": "anything", "user": "u", "safety_identifier": "s", "prompt_cache_key": "k",
        "metadata": {"a": "b"}, "service_tier": "auto", "store": False, "parallel_tool_calls": True,
        "stream_options": {"include_usage": True},
    }
    neutral = {
        "tools": [], "tool_choice": "none", "logit_bias": {}, "response_format": {"type": "text"},
        "modalities": ["text"], "n": 1, "logprobs": False, "frequency_penalty": 0, "presence_penalty": 0.0,
        "typical_p": 1.0, "mirostat": 0, "seed": 7,
    }
    async with http(engine) as c:
        chat = {k: values[k] for k in IGNORED["chat"]}
        events = await _stream(c, CHAT, messages=MESSAGES, max_tokens=2, **chat, **neutral)
        assert events[-1]["usage"]["completion_tokens"] == 2  # include_usage: the last chunk says it
        text = {k: values[k] for k in IGNORED["completions"]}  # stream_options without a stream too
        body = await _post(c, TEXT, prompt="x", max_tokens=2, echo=False, suffix="", best_of=1, **text)
        assert body["choices"][0]["logprobs"] is None


async def test_frequency_and_presence_penalties_change_greedy_text(ctx_engine: Any) -> None:
    """Honoured (llama.cpp's penalties over the last repeat_last_n tokens), not ignored."""
    async with http(ctx_engine) as c:
        plain = await _post(c, TEXT, prompt="the the the", max_tokens=24)
        freq = await _post(c, TEXT, prompt="the the the", max_tokens=24, frequency_penalty=2.0)
        pres = await _post(c, TEXT, prompt="the the the", max_tokens=24, presence_penalty=2.0)
        # repeat_penalty builds the same llama penalties sampler (it used to fail the step).
        rep = await _post(c, TEXT, prompt="the the the", max_tokens=24, repeat_penalty=1.5)
    assert rep["choices"][0]["text"] != plain["choices"][0]["text"]
    assert freq["choices"][0]["text"] != plain["choices"][0]["text"]
    assert pres["choices"][0]["text"] != plain["choices"][0]["text"]


async def test_min_tokens_holds_off_the_end_of_generation(ctx_engine: Any) -> None:
    """vLLM's min_tokens (vllm-router sends min_tokens: 1 with every P/D request): no
    end-of-generation token before that many tokens."""
    async with http(ctx_engine) as c:
        plain = await _post(c, CHAT, messages=OTHER_MESSAGES, max_tokens=40)
        n = plain["usage"]["completion_tokens"]
        assert plain["choices"][0]["finish_reason"] == "stop" and n < 30  # ends by itself
        held = await _post(c, CHAT, messages=OTHER_MESSAGES, max_tokens=40, min_tokens=n + 5, logprobs=True)
    assert held["usage"]["completion_tokens"] >= n + 5
    assert held["choices"][0]["message"]["content"].startswith(plain["choices"][0]["message"]["content"])
    assert len(held["choices"][0]["logprobs"]["content"]) == held["usage"]["completion_tokens"]


async def test_every_route_error_has_the_one_shape(engine: Any) -> None:
    async with http(engine) as c:
        replies = [
            await c.post(CHAT, content=b"{", headers={"content-type": "application/json"}),
            await c.get("/no/such/route"),
            await c.post("/tokenize", json={"content": 5}),
            await c.delete("/v1/decode/12345"),
            await c.post(CHAT, json={"messages": MESSAGES, "temperature": "hot"}),
        ]
    for r in replies:
        assert r.status_code >= 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, r.text
        assert err["code"] == r.status_code
    assert replies[-1].json()["error"]["param"] == "temperature"
