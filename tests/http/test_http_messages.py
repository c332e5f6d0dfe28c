"""Anthropic's Messages API over the chat pipeline (issue 40), through the unmodified
``anthropic`` SDK: messages.create, messages.stream, count_tokens and a forced tool; the
error shape, x-api-key, the billing header, and (hypothesis) a streamed message reassembles
to the unstreamed one.

The synthetic model's weights are random: only what a grammar forces is asserted."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_trio.engine import GenerationResult
from hydra_trio.http.messages import message_body, message_events, to_chat
from test_tools_http import PARAMS_OF, ROOMY, TIME_PARAMS, WEATHER_PARAMS

TOOLS = [
    {"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER_PARAMS},
    {"name": "get_time", "description": "Time in a zone", "input_schema": TIME_PARAMS},
]
GREEDY = {"temperature": 0}  # this SDK no longer has sampling keyword arguments
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def client(ep: Any, **kw: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=f"http://127.0.0.1:{ep.http_port}", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw
    )


@pytest.fixture
async def ep(start_engine: Any, tiny_model: Path) -> Any:
    return await start_engine(tiny_model, **ROOMY)


async def test_create_stream_and_count_tokens(ep: Any) -> None:
    sdk = client(ep)
    msg = await sdk.messages.create(
        model="claude-any", max_tokens=8, messages=USER, extra_body=GREEDY, system="Be brief."
    )
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    assert msg.usage.output_tokens >= 1 and msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 0
    async with sdk.messages.stream(
        model="claude-any", max_tokens=8, messages=USER, extra_body=GREEDY, system="Be brief."
    ) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_message()
    # Greedy both ways: the same text; the second found the prompt in the prefix cache.
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    assert final.stop_reason == msg.stop_reason
    assert (final.usage.cache_read_input_tokens or 0) > 0
    count = await sdk.messages.count_tokens(model="claude-any", messages=USER, system="Be brief.")
    assert count.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


async def test_forced_tool(ep: Any) -> None:
    sdk = client(ep)
    for choice in ({"type": "tool", "name": "get_time"}, {"type": "any"}):
        msg = await sdk.messages.create(
            model="claude-any", max_tokens=1500, messages=USER, tools=TOOLS, tool_choice=choice, extra_body=GREEDY  # type: ignore[arg-type]
        )
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert uses and msg.stop_reason == "tool_use", msg
        if choice["type"] == "tool":
            assert {u.name for u in uses} == {"get_time"}
        for use in uses:
            jsonschema.validate(use.input, PARAMS_OF[use.name])
    # Streamed, through the SDK's accumulator (input_json_delta), and a round trip after it.
    async with sdk.messages.stream(
        model="claude-any",
        max_tokens=1500,
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},  # type: ignore[arg-type]
        extra_body=GREEDY,
    ) as stream:
        final = await stream.get_final_message()
    use = next(b for b in final.content if b.type == "tool_use")
    jsonschema.validate(use.input, WEATHER_PARAMS)
    history = [*USER, {"role": "assistant", "content": [b.model_dump() for b in final.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    again = await sdk.messages.create(
        model="claude-any", max_tokens=4, messages=history, tools=TOOLS, extra_body=GREEDY
    )  # type: ignore[arg-type]
    assert again.usage.output_tokens >= 1


async def test_errors_auth_and_billing_header(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, api_key="sekrit", **ROOMY)
    base = f"http://127.0.0.1:{ep.http_port}"
    async with httpx.AsyncClient(base_url=base) as c:
        r = await c.post("/v1/messages", json={"messages": USER, "max_tokens": 4})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        hdr = {"x-api-key": "sekrit", "anthropic-version": "2023-06-01", "anthropic-beta": "whatever-2025"}
        r = await c.post("/v1/messages/nope", headers=hdr, json={})
        assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
        r = await c.post("/v1/nope", headers=hdr, json={})
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"  # OpenAI's shape
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
        r = await c.post(
            "/v1/messages", headers=hdr, json={"max_tokens": 4, "messages": [{"role": "user", "content": [image]}]}
        )
        assert r.status_code == 400 and "not supported" in r.json()["error"]["message"], r.text
        huge = [{"role": "user", "content": "the " * 20000}]
        r = await c.post("/v1/messages", headers=hdr, json={"max_tokens": 4, "messages": huge})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"type": "invalid_request_error", "message": r.json()["error"]["message"]}
        assert r.json()["error"]["message"].startswith("prompt is too long")
        r = await c.post("/v1/chat/completions", headers=hdr, json={"max_tokens": 4, "messages": huge})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        # Unknown fields are ignored; the billing-header line changes nothing in the prompt.
        extra = {
            "metadata": {"user_id": "u"},
            "context_management": {},
            "output_config": {"effort": "low"},
            "thinking": {"type": "adaptive"},
        }
        counts = []
        for n in (1, 2):
            system = [{"type": "text", "text": "x-anthropic-billing-header: "
                       f"cc_version=2.1.{n}; cch={n}"}, {"type": "text", "text": "You are Claude Code."}]
            r = await c.post(
                "/v1/messages/count_tokens", headers=hdr, json={"messages": USER, "system": system, **extra}
            )
            assert r.status_code == 200, r.text
            counts.append(r.json()["input_tokens"])
        plain = await c.post(
            "/v1/messages/count_tokens", headers=hdr, json={"messages": USER, "system": "You are Claude Code."}
        )
        assert counts == [plain.json()["input_tokens"]] * 2
    sdk = client(ep, api_key="sekrit")
    assert (await sdk.messages.create(model="m", max_tokens=2, messages=USER)).usage.output_tokens >= 1


def test_system_blocks_tool_results_and_choices_map_to_chat() -> None:
    chat = to_chat({
        "max_tokens": 9, "stop_sequences": ["END"], "top_k": 5,
        "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        "tools": [*TOOLS, {"type": "web_search_20250305", "name": "web_search"}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            *USER,
            {"role": "assistant",
             "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                         {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}]},
            {"role": "user",
             "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                          "content": [{"type": "text", "text": "12:00"}]}, {"type": "text", "text": "thanks"}]},
        ],
    })
    assert chat["messages"][0] == {"role": "system", "content": "a\n\nb"}
    assert chat["messages"][2]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert chat["messages"][2]["reasoning_content"] == "hm"
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "12:00"}
    assert chat["messages"][4] == {"role": "user", "content": "thanks"}
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather", "get_time"]  # the server tool dropped
    assert (chat["tool_choice"], chat["parallel_tool_calls"], chat["stop"], chat["top_k"]) == (
        "required",
        False,
        ["END"],
        5,
    )
    assert (
        to_chat({"max_tokens": 1, "messages": USER, "tools": TOOLS, "tool_choice": {"type": "none"}})["tool_choice"]
        == "none"
    )
    # Claude Code (2.1.x) sends system messages between the turns (its agent list, reminders).
    mid = to_chat({"max_tokens": 1, "messages": [*USER, {"role": "system", "content": "agents: claude"}, *USER]})
    assert mid["messages"][1] == {"role": "system", "content": "agents: claude"}
    blocks = to_chat(
        {"max_tokens": 1, "messages": [*USER, {"role": "system", "content": [{"type": "text", "text": "r"}]}]}
    )
    assert blocks["messages"][1] == {"role": "system", "content": "r"}


def test_a_deferred_tool_is_offered_once_loaded() -> None:
    """Anthropic's tool search (Claude Code with ENABLE_TOOL_SEARCH on, as a custom base URL
    leaves it): a ``defer_loading`` tool is not shown to the model until a ``tool_reference``
    names it (a ToolSearch result), the history calls it, or ``tool_choice`` forces it; Claude
    Code's DeferredToolPlaceholder ("never call this tool") is never offered."""
    placeholder = {"name": "DeferredToolPlaceholder", "description": "never call this tool",
                   "input_schema": {"type": "object", "properties": {}}, "defer_loading": True}
    fetch = {"name": "WebFetch", "input_schema": {"type": "object", "properties": {}}, "defer_loading": True}
    send = {"name": "SendMessage", "input_schema": {"type": "object", "properties": {}}, "defer_loading": True}
    tools = [*TOOLS, placeholder, fetch, send]

    def offered(messages: list[dict[str, Any]], **extra: Any) -> list[str]:
        chat = to_chat({"max_tokens": 1, "messages": messages, "tools": tools, **extra})
        return [t["function"]["name"] for t in chat.get("tools", [])]

    assert offered(USER) == ["get_weather", "get_time"]
    search = [
        *USER,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "tool_reference", "tool_name": "WebFetch"}]}]},
    ]
    assert offered(search) == ["get_weather", "get_time", "WebFetch"]
    called = [*search[:-1], {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t2", "name": "SendMessage", "input": {}}]}]
    assert offered(called) == ["get_weather", "get_time", "SendMessage"]
    forced = offered(USER, tool_choice={"type": "tool", "name": "WebFetch"})
    assert forced == ["get_weather", "get_time", "WebFetch"]
    # Only deferred tools, none loaded: no tools at all (and a tool_choice of any is moot).
    assert "tools" not in to_chat({"max_tokens": 1, "messages": USER, "tools": [placeholder],
                                   "tool_choice": {"type": "any"}})


def _sse(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for chunk in raw.decode().split("\n\n"):
        if chunk:
            name, data = chunk.split("\n", 1)
            ev = json.loads(data.removeprefix("data: "))
            assert name == f"event: {ev['type']}"
            out.append(ev)
    return out


def reassemble(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the SDK's accumulator does: the blocks of a stream, their deltas joined."""
    blocks: list[dict[str, Any]] = []
    for ev in events:
        if ev["type"] == "content_block_start":
            assert ev["index"] == len(blocks)
            blocks.append(dict(ev["content_block"]))
        elif ev["type"] == "content_block_delta":
            block, d = blocks[ev["index"]], ev["delta"]
            if d["type"] == "text_delta":
                block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] += d["thinking"]
            else:
                block.setdefault("json", "")
                block["json"] += d["partial_json"]
    for block in blocks:
        if "json" in block:
            block["input"] = json.loads(block.pop("json"))
    return blocks


def _joined(blocks: list[dict[str, Any]]) -> tuple[str, str, list[Any]]:
    return (
        "".join(b.get("thinking", "") for b in blocks),
        "".join(b.get("text", "") for b in blocks),
        [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"],
    )


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet='ab <>/thinkool_c{}":', max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=8),
    think=st.booleans(),
)
def test_streamed_events_reassemble_to_the_message(text: str, cuts: list[int], think: bool) -> None:
    from hydra_trio.engine.chat import ReplyParser
    from hydra_trio.engine.chat.formats import FORMATS

    HERMES = FORMATS["hermes"]

    reply = (
        ("<think>" + text[:10] + "</think>" if think else "")
        + text
        + '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    )
    res = GenerationResult(prompt_tokens=10, n_common=4, completion_tokens=5, stop_type="eos")
    res.text = reply

    def parser() -> Any:
        return ReplyParser(HERMES, parse_tools=True, reasoning=True)

    whole = message_body("msg_1", "m", res, parser(), [])
    events = message_events("msg_1", "m", 10, parser(), [])
    raw = events.head
    points = sorted({c for c in cuts if c < len(reply)} | {0, len(reply)})
    for a, b in itertools.pairwise(points):
        raw += events.delta(reply[a:b])
    raw += events.done(res)
    evs = _sse(raw)
    assert [e["type"] for e in evs[:2]] == ["message_start", "ping"] and evs[-1]["type"] == "message_stop"
    assert evs[-2]["delta"]["stop_reason"] == whole["stop_reason"] and evs[-2]["usage"] == whole["usage"]
    assert _joined(reassemble(evs)) == _joined(whole["content"])


THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


async def test_reasoning_comes_back_as_thinking_blocks(start_engine: Any, tiny_model: Path, tmp_path: Path) -> None:
    """A template whose generation prompt opens <think>: the reply starts in its reasoning, so
    (random weights, no </think> in a few tokens) it is all thinking, whole and streamed."""
    template = tmp_path / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    ep = await start_engine(tiny_model, chat_template_file=str(template), **ROOMY)
    sdk = client(ep)
    kw: Any = {"model": "m", "max_tokens": 6, "messages": USER, "thinking": {"type": "adaptive"}, "extra_body": GREEDY}
    msg = await sdk.messages.create(**kw)
    assert [b.type for b in msg.content] == ["thinking"] and msg.content[0].thinking, msg  # type: ignore[union-attr]
    async with sdk.messages.stream(**kw) as stream:
        final = await stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]


UNSATISFIABLE = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
    "required": ["n"],
}


async def test_refusals_name_what_the_client_sent(ep: Any) -> None:
    """A refusal on /v1/messages names the request's own keys: ``tools[3].input_schema`` (its
    index past a server tool the codec drops), ``output_format``; in Anthropic's shape."""
    tools = [
        {"type": "web_search_20250305", "name": "web_search"},
        *TOOLS,
        {"name": "bad", "input_schema": UNSATISFIABLE},
    ]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ep.http_port}") as c:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            body: dict[str, Any] = {"model": "m", "max_tokens": 8, "messages": USER, "tools": tools}
            r = await c.post(path, json=body)
            if path.endswith("count_tokens"):  # counting needs no grammar: the tools are counted
                assert r.status_code == 200, r.text
                continue
            assert r.status_code == 400, r.text
            err = r.json()
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
            message = err["error"]["message"]
            assert message.startswith("tools[3].input_schema") and "function" not in message, message
        fmt = {"type": "json_schema", "schema": UNSATISFIABLE}
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": USER, "output_format": fmt})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("output_format.schema"), r.text


async def test_a_cut_forced_call_is_never_a_text_block(ep: Any) -> None:
    """The length cap in the middle of forced calls: the reply's whole calls as tool_use blocks,
    stop_reason max_tokens, and no text block holding call syntax (issue 49)."""
    sdk = client(ep)
    for max_tokens in range(4, 80, 5):
        msg = await sdk.messages.create(
            model="m", max_tokens=max_tokens, messages=USER, tools=TOOLS, tool_choice={"type": "any"}, extra_body=GREEDY  # type: ignore[arg-type]
        )
        assert all(b.type == "tool_use" for b in msg.content), (max_tokens, msg.content)
        assert msg.stop_reason in ("max_tokens", "tool_use"), msg
        for use in (b for b in msg.content if b.type == "tool_use"):
            jsonschema.validate(use.input, PARAMS_OF[use.name])
        async with sdk.messages.stream(
            model="m", max_tokens=max_tokens, messages=USER, tools=TOOLS, tool_choice={"type": "any"}, extra_body=GREEDY  # type: ignore[arg-type]
        ) as stream:
            final = await stream.get_final_message()
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
