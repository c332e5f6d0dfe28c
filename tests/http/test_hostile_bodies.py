"""Bodies and replies that were 5xx or broken streams (issue 50), each now a 400 in its API's
own shape, or a reply that ends as it should: Responses' ``text.format`` of the wrong type
and reasoning items of the wrong shape, ``max_tokens: 0``, template kwargs that would set
what the engine renders, the early 413 on /v1/messages*, a model that writes JSON nested a
thousand deep in a format that reads calls without tools, and a stream whose event cannot be
built (it ends with its error event, and ``[DONE]`` where the dialect has one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from hydra_trio.engine.chat import render_jinja
from hydra_trio.testing.sse_reader import parse_sse
from hydra_trio.wire import ProtocolError

USER = [{"role": "user", "content": "hello world"}]


def anthropic_shaped(r: httpx.Response, status: int) -> bool:
    body = r.json()
    return r.status_code == status and body.get("type") == "error" and set(body["error"]) == {"type", "message"}


def openai_shaped(r: httpx.Response, status: int) -> bool:
    err = r.json().get("error")
    return (
        r.status_code == status
        and isinstance(err, dict)
        and err.get("code") == status
        and isinstance(err.get("message"), str)
    )


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/responses", {"input": "hi", "text": {"format": "json"}}, "text.format"),
    ("/v1/responses", {"input": "hi", "text": {"format": ["x"]}}, "text.format"),
    ("/v1/responses/input_tokens", {"input": "hi", "text": {"format": "json"}}, "text.format"),
    ("/v1/responses/input_tokens", {"input": "hi", "text": {"format": ["x"]}}, "text.format"),
    ("/v1/responses", {"input": [{"type": "reasoning", "content": 5}, {"role": "user", "content": "x"}]}, "input"),
    ("/v1/responses", {"input": [{"type": "reasoning", "summary": 7}, {"role": "user", "content": "x"}]}, "input"),
    ("/v1/responses/input_tokens", {"input": [{"type": "reasoning", "summary": 7}, {"role": "user", "content": "x"}]},
     "input"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions",
     {"messages": USER, "chat_template_kwargs": {"messages": [{"role": "user", "content": "x"}]}},
     "chat_template_kwargs.messages"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"tools": [{"name": "shown"}]}},
     "chat_template_kwargs.tools"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs.add_generation_prompt"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"eos_token": "x"}},
     "chat_template_kwargs.eos_token"),
    ("/apply-template", {"messages": USER, "chat_template_kwargs": {"bos_token": "x"}},
     "chat_template_kwargs.bos_token"),
    ("/v1/chat/completions/render", {"messages": USER, "chat_template_kwargs": {"raise_exception": 1}},
     "chat_template_kwargs.raise_exception"),
]


async def test_bodies_that_were_5xx_are_400s_in_their_apis_shape(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, max_json_bytes=1 << 20)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ep.http_port}", timeout=30) as c:
        for path, body, param in REFUSED:
            r = await c.post(
                path, json={"max_output_tokens": 4, **body} if "responses" in path and path.endswith("s") else body
            )
            assert openai_shaped(r, 400) and r.json()["error"]["param"] == param, (path, body, r.text)
        assert "messages" in (await c.post(*REFUSED[11][:1], json=REFUSED[11][1])).json()["error"]["message"]
        # None of them generated a token.
        metrics = (await c.get("/metrics")).text
        assert not any(
            ln.startswith("vllm:generation_tokens_total") and not ln.endswith(" 0.0") for ln in metrics.splitlines()
        )
        # The early 413 (a declared body past --max-json-bytes, refused before the app) in Anthropic's shape there.
        big = b"{" + b" " * (2 << 20) + b"}"
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = await c.post(path, content=big, headers={"content-type": "application/json"})
            assert anthropic_shaped(r, 413) and r.json()["error"]["type"] == "request_too_large", r.text
        r = await c.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
        assert openai_shaped(r, 413), r.text
        # And the template kwargs that are the request's to set still are.
        r = await c.post(
            "/apply-template", json={"messages": USER, "chat_template_kwargs": {"enable_thinking": True, "flavour": 1}}
        )
        assert r.status_code == 200, r.text


def test_template_kwargs_may_not_set_what_the_engine_renders() -> None:
    src = "{{ messages | length }}|{{ bos_token }}|{{ tools is defined }}|{{ date_string }}"
    kw = {"bos_token": "<s>", "eos_token": "</s>"}
    assert render_jinja({"messages": USER, "chat_template_kwargs": {"date_string": "D"}}, src, **kw) == "1|<s>|False|D"
    for name in (
        "messages",
        "tools",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "namespace",
        "range",
        "strftime_now",
    ):
        with pytest.raises(ProtocolError, match=f"may not set {name}"):
            render_jinja({"messages": USER, "chat_template_kwargs": {name: 1}}, src, **kw)


# Cohere's format drops its content markup, so its reader runs on every reply, tools or not: a
# client's grammar makes the model write a block of calls whose JSON nests 1,000 deep.
DEEP = "[" * 1000 + "]" * 1000
DEEP_GRAMMAR = f'root ::= "<|START_ACTION|>" {json.dumps(DEEP)} "<|END_ACTION|>"\n'


async def test_a_reply_nested_a_thousand_deep_is_content(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, tool_call_parser="cohere", slots=1, ctx_size=4096)
    body = {"messages": USER, "grammar": DEEP_GRAMMAR, "max_tokens": 3000, "temperature": 0}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ep.http_port}", timeout=120) as c:
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "<|START_ACTION|>" + DEEP + "<|END_ACTION|>"
        r = await c.post("/v1/chat/completions", json={**body, "stream": True})
        events, done = parse_sse(r.text.splitlines())
        assert done, r.text[-300:]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        assert text == "<|START_ACTION|>" + DEEP + "<|END_ACTION|>"
        r = await c.post("/v1/messages", json={"messages": USER, "max_tokens": 3000, "stream": True, "temperature": 0})
        assert r.status_code == 200 and "message_stop" in r.text  # the engine goes on serving


async def test_a_stream_whose_event_cannot_be_built_ends_with_its_error_event(
    start_engine: Any, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hydra_trio.http.completions import ReplyEvents
    from hydra_trio.http.generation import BlockStream

    def broken(self: Any, text: str) -> bytes:
        raise RuntimeError("an event that cannot be built")

    for cls in (ReplyEvents, BlockStream):
        monkeypatch.setattr(cls, "delta", broken)
    ep = await start_engine(tiny_model)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ep.http_port}", timeout=30) as c:
        # reasoning_format deepseek: the reply is parsed, its events built by ReplyEvents
        chat = {"messages": USER, "max_tokens": 8, "stream": True, "reasoning_format": "deepseek"}
        r = await c.post("/v1/chat/completions", json=chat)
        events, done = parse_sse(r.text.splitlines())
        assert done and events[-1]["error"]["code"] == 500, r.text
        r = await c.post("/v1/messages", json={"messages": USER, "max_tokens": 8, "stream": True})
        assert r.text.rstrip().split("\n\n")[-1].startswith("event: error"), r.text
        r = await c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 8, "stream": True})
        assert r.text.rstrip().split("\n\n")[-1].startswith("event: error"), r.text
        monkeypatch.undo()
        r = await c.post("/v1/chat/completions", json={**chat, "stream": False})
        assert r.status_code == 200  # the engine is well


async def test_routes_that_need_no_slot_are_admitted_a_few_at_a_time(start_engine: Any, tiny_model: Path) -> None:
    """count_tokens, input_tokens and the tokenizer routes hold no slot, so nothing else bounds
    how many run at once: SLOTLESS_AT_ONCE do, the others wait --slot-wait-s, then the one
    "busy, retry" 503 in their API's shape. Held here at the GPU worker (each waits there to
    tokenize, holding its place)."""
    from helpers import WorkerGate
    from hydra_trio.http.plumbing import SLOTLESS_AT_ONCE

    ep = await start_engine(tiny_model, slot_wait_s=1.0)
    gate = WorkerGate(ep.state.engine)
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ep.http_port}", timeout=30) as c:

        async def count() -> None:
            r = await c.post("/v1/messages/count_tokens", json={"messages": USER})
            statuses.append(r.status_code)

        await gate.close()
        async with trio.open_nursery() as nursery:
            for _ in range(SLOTLESS_AT_ONCE):
                nursery.start_soon(count)
            await gate.wait_queued(SLOTLESS_AT_ONCE)  # each holds its place, waiting for the worker
            r = await c.post("/v1/messages/count_tokens", json={"messages": USER})
            assert anthropic_shaped(r, 503) and r.json()["error"]["type"] == "overloaded_error", r.text
            assert r.headers["retry-after"] == "1"
            r = await c.post("/v1/responses/input_tokens", json={"input": "hi"})
            assert openai_shaped(r, 503), r.text
            gate.open()
        assert statuses == [200] * SLOTLESS_AT_ONCE
        r = await c.post("/tokenize", json={"content": "hello"})  # places free again
        assert r.status_code == 200


async def test_more_turns_than_a_slot_has_positions_are_refused_before_anything_reads_them(
    start_engine: Any, tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)  # 2,048 positions a slot
    turns = [{"role": "user", "content": "a"}] * 2048
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ep.http_port}", timeout=30) as c:
        r = await c.post("/v1/chat/completions", json={"messages": turns, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded" and "turns" in r.text, (
            r.text
        )
        r = await c.post("/v1/messages/count_tokens", json={"messages": turns})
        assert anthropic_shaped(r, 400) and r.json()["error"]["message"].startswith("prompt is too long"), r.text
        r = await c.post("/v1/responses/input_tokens", json={"input": turns})
        assert r.status_code == 400 and "turns" in r.text, r.text
