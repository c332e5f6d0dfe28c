"""OpenAI's Responses API over the chat pipeline (issue 40), through the unmodified ``openai``
SDK: responses.create plain, streamed, with a forced function call and with text.format; input
items (function_call, function_call_output, reasoning), the no-store 400, dropped tool types,
and (hypothesis) a streamed response reassembles to the unstreamed one.

The synthetic model's weights are random: only what a grammar forces is asserted."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from hydra_trio.engine import GenerationResult
from hydra_trio.http.responses import Shell, response_body, response_events, to_chat
from test_tools_http import PARAMS_OF, ROOMY, TIME_PARAMS, WEATHER_PARAMS

TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER_PARAMS},
    {"type": "function", "name": "get_time", "description": "Time in a zone", "parameters": TIME_PARAMS},
]
CODEX_EXTRAS: list[Any] = [{"type": "web_search"}, {"type": "namespace", "name": "mcp", "tools": []}]
INPUT: list[Any] = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
]


class Forecast(BaseModel):
    city: str = Field(max_length=8)
    days: int
    sunny: bool


def client(ep: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{ep.http_port}/v1", api_key="unused", max_retries=0)


@pytest.fixture
async def ep(start_engine: Any, tiny_model: Path) -> Any:
    return await start_engine(tiny_model, **ROOMY)


async def test_create_and_stream(ep: Any) -> None:
    sdk = client(ep)
    resp = await sdk.responses.create(
        model="any", input="hello there", instructions="Be brief.", max_output_tokens=8, temperature=0, store=False
    )
    assert resp.object == "response" and resp.status in ("completed", "incomplete")
    assert resp.output_text and resp.usage is not None and resp.usage.output_tokens >= 1
    seqs: list[int] = []
    last: Any = None
    async with sdk.responses.stream(
        model="any", input="hello there", instructions="Be brief.", max_output_tokens=8, temperature=0
    ) as stream:
        async for ev in stream:
            seqs.append(ev.sequence_number)
            last = ev
    assert seqs == list(range(len(seqs)))
    # Cut by max_output_tokens, a stream ends in response.incomplete (as OpenAI's does), which
    # the SDK's get_final_response does not take: the response is that event's.
    assert last.type == f"response.{resp.status}"
    final = last.response
    assert final.output_text == resp.output_text and final.status == resp.status  # greedy both ways
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens > 0  # the prefix cache
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ep.http_port}") as c:
        r = await c.post("/v1/responses/input_tokens", json={"input": "hello there", "instructions": "Be brief."})
        assert r.json() == {"object": "response.input_tokens", "input_tokens": resp.usage.input_tokens}
        r = await c.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_1"})
        assert r.status_code == 400 and "stores no responses" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "previous_response_id"
        r = await c.post(
            "/v1/responses", json={"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}
        )
        assert r.status_code == 400 and "not supported" in r.json()["error"]["message"]


async def test_forced_function_call_and_round_trip(ep: Any) -> None:
    sdk = client(ep)
    for choice in ({"type": "function", "name": "get_time"}, "required"):
        resp = await sdk.responses.create(
            model="any",
            input=INPUT,
            tools=TOOLS + CODEX_EXTRAS,
            tool_choice=choice,
            max_output_tokens=1500,
            temperature=0,  # type: ignore[arg-type]
            parallel_tool_calls=False,
        )
        calls = [o for o in resp.output if o.type == "function_call"]
        assert len(calls) == 1, resp.output
        if choice != "required":
            assert calls[0].name == "get_time"
        jsonschema.validate(json.loads(calls[0].arguments), PARAMS_OF[calls[0].name])
    async with sdk.responses.stream(
        model="any",
        input=INPUT,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=1500,
        temperature=0,
    ) as stream:
        final = await stream.get_final_response()
    call = next(o for o in final.output if o.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    # Codex's next turn: the call and its output as input items (no stored response).
    turn = [*INPUT, {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "look it up"}]},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    again = await sdk.responses.create(
        model="any", input=turn, tools=TOOLS, max_output_tokens=4, temperature=0, store=False
    )  # type: ignore[arg-type]
    assert again.usage is not None and again.usage.output_tokens >= 1


async def test_text_format(ep: Any) -> None:
    sdk = client(ep)
    parsed = await sdk.responses.parse(
        model="any", input="forecast?", text_format=Forecast, max_output_tokens=200, temperature=0
    )
    assert isinstance(parsed.output_parsed, Forecast), parsed.output
    resp = await sdk.responses.create(
        model="any", input="json please", text={"format": {"type": "json_object"}}, max_output_tokens=60, temperature=0
    )
    if resp.status == "completed":
        assert isinstance(json.loads(resp.output_text), dict)


def test_input_items_map_to_chat() -> None:
    chat = to_chat({
        "instructions": "sys", "input": [
            *INPUT,
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": '{"zone":"UTC"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": '{"zone":"CET"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
            {"type": "web_search_call", "id": "ws_1"},
        ],
        "tools": TOOLS + CODEX_EXTRAS, "tool_choice": "required", "reasoning": {"effort": "none"},
        "max_output_tokens": 7,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}, "store": False,
        "include": ["reasoning.encrypted_content"],
    })
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "system", "user", "assistant", "tool"]
    assert chat["messages"][3]["reasoning_content"] == "hm" and [
        c["id"] for c in chat["messages"][3]["tool_calls"]
    ] == ["c1", "c2"]
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather", "get_time"]
    assert chat["chat_template_kwargs"] == {"enable_thinking": False} and chat["max_tokens"] == 7
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"} and chat["tool_choice"] == "required"


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
    """The output items a client builds from the deltas alone."""
    items: list[dict[str, Any]] = []
    for ev in events:
        if ev["type"] == "response.output_item.added":
            assert ev["output_index"] == len(items)
            items.append({"type": ev["item"]["type"], "text": "", "name": ev["item"].get("name")})
        elif ev["type"] in ("response.output_text.delta", "response.reasoning_text.delta", "response.function_call_"
                            "arguments.delta"):
            items[ev["output_index"]]["text"] += ev["delta"]
    return items


def _joined(items: list[dict[str, Any]]) -> tuple[str, str, list[Any]]:
    return (
        "".join(i["text"] for i in items if i["type"] == "reasoning"),
        "".join(i["text"] for i in items if i["type"] == "message"),
        [(i["name"], json.loads(i["text"])) for i in items if i["type"] == "function_call"],
    )


def _flat(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    flat = []
    for o in output:
        text = o["arguments"] if o["type"] == "function_call" else "".join(p["text"] for p in o["content"])
        flat.append({"type": o["type"], "text": text, "name": o.get("name")})
    return flat


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet='ab <>/thinkool_c{}":', max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=8),
    think=st.booleans(),
)
def test_streamed_events_reassemble_to_the_response(text: str, cuts: list[int], think: bool) -> None:
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

    shell = Shell("resp_1", "m", {"input": "x"}, {})
    whole = response_body(shell, res, parser())
    events = response_events(shell, parser())
    raw = events.head
    points = sorted({c for c in cuts if c < len(reply)} | {0, len(reply)})
    for a, b in itertools.pairwise(points):
        raw += events.delta(reply[a:b])
    raw += events.done(res)
    evs = _sse(raw)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert [e["type"] for e in evs[:2]] == ["response.created", "response.in_progress"] and evs[-1][
        "type"
    ] == "response.completed"
    final = evs[-1]["response"]
    assert final["usage"] == whole["usage"] and final["status"] == whole["status"]
    assert _joined(reassemble(evs)) == _joined(_flat(whole["output"])) == _joined(_flat(final["output"]))


async def test_reasoning_comes_back_as_a_reasoning_item(start_engine: Any, tiny_model: Path, tmp_path: Path) -> None:
    from test_http_messages import THINK_TEMPLATE

    template = tmp_path / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    sdk = client(await start_engine(tiny_model, chat_template_file=str(template), **ROOMY))
    kw: Any = {"model": "m", "input": "hi", "max_output_tokens": 6, "temperature": 0, "reasoning": {"effort": "high"}}
    resp = await sdk.responses.create(**kw)
    assert [o.type for o in resp.output] == ["reasoning"] and resp.output[0].content[0].text, resp.output  # type: ignore[union-attr,index]
    last: Any = None
    async with sdk.responses.stream(**kw) as stream:
        async for ev in stream:
            last = ev
    assert last.response.output[0].model_dump()["content"] == resp.output[0].model_dump()["content"]


async def test_refusals_name_what_the_client_sent(ep: Any) -> None:
    """A refusal on /v1/responses names the request's own keys: ``tools[2].parameters`` (its
    index past a tool the codec drops), ``text.format.schema``, ``max_output_tokens``."""
    bad = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]}
    tools = [*CODEX_EXTRAS[:1], TOOLS[0], {"type": "function", "name": "bad", "parameters": bad}]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ep.http_port}") as c:
        r = await c.post("/v1/responses", json={"input": "hi", "tools": tools, "max_output_tokens": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[2].parameters", r.text
        assert "function" not in r.json()["error"]["message"], r.text
        fmt = {"type": "json_schema", "name": "x", "schema": bad, "strict": True}
        r = await c.post("/v1/responses", json={"input": "hi", "text": {"format": fmt}, "max_output_tokens": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema", r.text
        r = await c.post("/v1/responses", json={"input": "hi", "max_output_tokens": -3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens", r.text


async def test_a_cut_forced_call_is_never_message_text(ep: Any) -> None:
    sdk = client(ep)
    for max_tokens in range(4, 80, 5):
        resp = await sdk.responses.create(
            model="any", input=INPUT, tools=TOOLS, tool_choice="required", max_output_tokens=max_tokens, temperature=0,  # type: ignore[arg-type]
        )
        assert all(o.type == "function_call" for o in resp.output), (max_tokens, resp.output)
        for call in resp.output:
            jsonschema.validate(json.loads(call.arguments), PARAMS_OF[call.name])  # type: ignore[union-attr]
