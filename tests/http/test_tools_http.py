"""Tool calls over HTTP (issue 30): ``tools``, ``tool_choice`` and ``parallel_tool_calls`` on
chat, streamed ``delta.tool_calls``, ``role: "tool"`` messages through the template, tool
calls on ``GET /v1/decode/{id}`` and through the P/D hand-off, and reasoning_content.

The synthetic model's weights are random: with ``required`` or a named function decoding is
grammar-forced, so only what the grammar forces is asserted (the calls parse, name a declared
tool and their arguments validate against its parameters)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from helpers import (
    ENGINE,
    MESSAGES,
    assert_server_healthy,
    chat,
    chat_text,
    decode_ok,
    get_result,
    http,
    rpc,
    stream_chat,
)
from hydra_trio.rpc.client import build_decode_frame
from hydra_trio.testing.sse_reader import sse_chunk

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER_PARAMS},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME_PARAMS}},
]
PARAMS_OF = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
# Room for the tools' description and up to 8 calls: the synthetic vocabulary spends about a
# token a character.
ROOMY = {"ctx_size": 16384}


@pytest.fixture
async def engine(start_engine: Any, tiny_model: Path) -> Any:
    return await start_engine(tiny_model, **ROOMY)

# A Hermes/Qwen-style template: it prints the tools, earlier calls and tool results itself.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}You may call functions. Their signatures:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each call, reply with <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- if message.tool_calls %}{% for tool_call in message.tool_calls %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def check_calls(message: dict[str, Any], *, name: str | None = None) -> list[dict[str, Any]]:
    """The message's tool calls, each checked: an id, a declared name (``name`` when given)
    and arguments that are JSON valid for that tool's parameters."""
    calls = message["tool_calls"]
    assert calls, message
    for call in calls:
        assert call["type"] == "function"
        assert call["id"].startswith("call_")
        fn = call["function"]
        assert fn["name"] in PARAMS_OF, fn
        if name is not None:
            assert fn["name"] == name
        assert isinstance(fn["arguments"], str)
        jsonschema.validate(json.loads(fn["arguments"]), PARAMS_OF[fn["name"]])
    return calls


def reassembled(events: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], str | None]:
    """A stream's content, its tool calls put together from ``delta.tool_calls`` by index (as
    the OpenAI SDK does: arguments concatenated), and its finish_reason."""
    content, calls, finish = "", {}, None
    for ev in events:
        choice = ev["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for part in delta.get("tool_calls") or []:
            call = calls.setdefault(
                part["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] += part.get("id") or ""
            fn = part.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
        finish = choice.get("finish_reason") or finish
    return content, [calls[i] for i in sorted(calls)], finish


def without_ids(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser", ["generic", "hermes", "llama3", "mistral"])
async def test_required_tool_choice_gives_calls_that_parse(start_engine: Any, tiny_model: Path, parser: str) -> None:
    ep = await start_engine(tiny_model, tool_call_parser=parser, **ROOMY)
    async with http(ep) as h:
        for prompt in ("what is the weather in Paris?", "time please", "hello"):
            body = await chat(
                h, messages=[{"role": "user", "content": prompt}], tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False, max_tokens=600,
            )
            choice = body["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            assert len(check_calls(choice["message"])) == 1
            assert choice["message"]["content"] is None


async def test_a_named_function_is_the_one_called(engine: Any) -> None:
    async with http(engine) as h:
        for name in ("get_time", "get_weather"):
            body = await chat(
                h, tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}}, max_tokens=600
            )
            check_calls(body["choices"][0]["message"], name=name)  # every call names it


async def test_parallel_calls_each_parse(engine: Any) -> None:
    """parallel_tool_calls (the default) lets one reply hold up to 8 calls: each one parses."""
    async with http(engine) as h:
        body = await chat(h, tools=TOOLS, tool_choice="required", max_tokens=1500)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert 1 <= len(check_calls(choice["message"])) <= 8


@pytest.mark.parametrize("parser", ["generic", "hermes"])
async def test_stream_deltas_reassemble_to_the_whole_reply(start_engine: Any, tiny_model: Path, parser: str) -> None:
    """Two engines, each from an empty slot: the same computation streamed and not."""
    a = await start_engine(tiny_model, tool_call_parser=parser, **ROOMY)
    b = await start_engine(tiny_model, tool_call_parser=parser, **ROOMY)
    request = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 1500, "messages": MESSAGES}
    async with http(a) as ha, http(b) as hb:
        whole = (await chat(ha, **request))["choices"][0]
        events, done, _ = await stream_chat(hb, **request)
    assert done
    content, calls, finish = reassembled(events)
    assert finish == whole["finish_reason"] == "tool_calls"
    assert content == (whole["message"]["content"] or "")
    assert without_ids(calls) == without_ids(check_calls(whole["message"]))
    assert all(c["id"].startswith("call_") for c in calls)


async def test_tool_messages_round_trip_through_the_template(
    start_engine: Any, tiny_model: Path, tmp_path: Path
) -> None:
    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    ep = await start_engine(tiny_model, chat_template_file=str(template), **ROOMY)
    history = [
        {"role": "user", "content": "weather in Rome for 2 days?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    async with http(ep) as h:
        r = await h.post("/apply-template", json={"messages": history, "tools": TOOLS})
        assert r.status_code == 200, r.text
        prompt = r.json()["prompt"]
        # The template printed the tools, the call with its arguments as an object, the result.
        assert '"name": "get_weather"' in prompt and "<tools>" in prompt
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>' in prompt
        assert "<tool_response>\nsunny, 24 C\n</tool_response>" in prompt
        body = await chat(h, messages=history, tools=TOOLS, tool_choice="required", max_tokens=600)
        check_calls(body["choices"][0]["message"])


async def test_a_template_that_lists_tools_renders_them_as_llama_server_does(engine: Any) -> None:
    """The synthetic model's ChatML lists the tools itself (``# Tools``) but has no call
    syntax. As llama-server renders it (checked against its /apply-template, issue 41): the
    template's own listing, no generic description of ours, the system message after it,
    and, as there, an earlier call the template cannot show is not shown."""
    history = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "time?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"UTC"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    async with http(engine) as h:
        r = await h.post("/apply-template", json={"messages": history, "tools": TOOLS})
        assert r.status_code == 200, r.text
        prompt = r.json()["prompt"]
        listing = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in TOOLS)
        assert prompt == (
            f"<|im_start|>system\n# Tools\n{listing}<|im_end|>\n<|im_start|>system\nbe brief<|im_end|>\n"
            "<|im_start|>user\ntime?<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
            "<|im_start|>tool\n12:00<|im_end|>\n<|im_start|>assistant\n"
        ), prompt
        assert "You can call the following tools" not in prompt


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "grammar": 'root ::= "a"'}, "grammar"),  # a client's GBNF has no call syntax to join
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "reasoning_format": "sideways"}, "reasoning_format"),
    ],
)
async def test_bad_tool_requests_are_refused_naming_the_parameter(
    engine: Any, extra: dict[str, Any], param: str
) -> None:
    async with http(engine) as h:
        r = await h.post("/v1/chat/completions", json={"messages": MESSAGES, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] is not None and err["param"].startswith(param), err
    await assert_server_healthy(engine)


ANSWER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
    "required": ["city", "ok"],
    "additionalProperties": False,
}


async def test_tools_beside_a_typed_answer(engine: Any) -> None:
    """An agent framework's turn: tools and a typed final answer together. ``required`` and a
    named tool write calls (the answer waits for a later turn); ``auto`` writes a call or a
    document of the answer's schema, nothing else; ``none`` the document."""
    fmt = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": ANSWER, "strict": True}}
    sampled = [{"temperature": 0}] + [
        {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": s} for s in range(4)
    ]
    async with http(engine) as h:
        for sampling in sampled:
            body = await chat(h, tools=TOOLS, tool_choice="required", response_format=fmt, max_tokens=1500, **sampling)
            assert body["choices"][0]["finish_reason"] == "tool_calls", body
            check_calls(body["choices"][0]["message"])
            named = {"type": "function", "function": {"name": TOOLS[1]["function"]["name"]}}
            body = await chat(h, tools=TOOLS, tool_choice=named, response_format=fmt, max_tokens=1500, **sampling)
            assert len(check_calls(body["choices"][0]["message"], name=TOOLS[1]["function"]["name"])) == 1
            body = await chat(h, tools=TOOLS, tool_choice="auto", response_format=fmt, max_tokens=1500, **sampling)
            message, reason = body["choices"][0]["message"], body["choices"][0]["finish_reason"]
            if message.get("tool_calls"):
                assert reason == "tool_calls" and not message.get("content"), body
                check_calls(message)
            else:
                assert reason == "stop", body
                jsonschema.validate(json.loads(message["content"]), ANSWER)
            body = await chat(h, tools=TOOLS, tool_choice="none", response_format=fmt, max_tokens=1500, **sampling)
            jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), ANSWER)
    await assert_server_healthy(engine)


async def test_tool_choice_none_renders_tools_and_parses_nothing(engine: Any) -> None:
    async with http(engine) as h:
        body = await chat(h, tools=TOOLS, tool_choice="none", max_tokens=8)
        choice = body["choices"][0]
        assert "tool_calls" not in choice["message"]
        assert isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length")


async def test_auto_compiles_a_lazy_grammar_once(engine: Any) -> None:
    async with http(engine) as h:
        grammars = engine.state.engine._core.inputs.grammars
        before = grammars.compiles
        for _ in range(2):
            body = await chat(h, tools=TOOLS, tool_choice="auto", max_tokens=8)
            assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
        assert grammars.compiles == before + 1


async def test_decode_returns_tool_calls_like_chat(engine: Any) -> None:
    """DECODE carries the tools in its generation parameters: the result is constrained and
    parsed as chat's is (JSON and SSE)."""
    async with await rpc(engine) as c, http(engine) as h:
        payload = build_decode_frame(
            {"messages": MESSAGES, "n_predict": 1500, "temperature": 0},
            generation={"tools": TOOLS, "tool_choice": "required"},
        )
        rid = await decode_ok(c, 0, payload)
        body = await get_result(h, rid)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        calls = check_calls(choice["message"])
        async with h.stream("GET", f"/v1/decode/{rid}", headers={"Accept": "text/event-stream"}) as r:
            lines = [line async for line in r.aiter_lines()]
    events = [c for line in lines if (c := sse_chunk(line)) is not None]
    content, streamed, finish = reassembled(events)
    assert content == (choice["message"]["content"] or "")
    assert finish == "tool_calls"
    assert without_ids(streamed) == without_ids(calls)


async def test_pd_handoff_with_tools_matches_one_engine(start_engine: Any, tiny_model_ctx: Path) -> None:
    a = await start_engine(tiny_model_ctx, **ENGINE, **ROOMY)
    b = await start_engine(tiny_model_ctx, **ENGINE, **ROOMY)
    body = {"messages": MESSAGES, "temperature": 0, "tools": TOOLS, "tool_choice": "required"}
    async with http(a) as ca, http(b) as cb:
        reference = (await chat(ca, **body, max_tokens=1500))["choices"][0]
        pre = await chat(ca, **body, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)
        r = await cb.post(
            "/v1/chat/completions", json={**body, "max_tokens": 1500, "kv_transfer_params": pre["kv_transfer_params"]}
        )
        assert r.status_code == 200, r.text
        handed = r.json()
        assert handed["kv_transfer"]["status"] == "restored", handed["kv_transfer"]
        choice = handed["choices"][0]
    assert choice["finish_reason"] == reference["finish_reason"] == "tool_calls"
    assert without_ids(check_calls(choice["message"])) == without_ids(check_calls(reference["message"]))


async def test_reasoning_is_split_out_when_the_prompt_opens_a_think(
    start_engine: Any, tiny_model: Path, tmp_path: Path
) -> None:
    """A template whose generation prompt opens <think> (DeepSeek-R1's way): the reply starts
    in its reasoning. The grammar forces ``...</think>`` then an answer, so the split is seen
    on random weights; ``reasoning_format: none`` keeps it inline."""
    template = tmp_path / "think.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )
    ep = await start_engine(tiny_model, chat_template_file=str(template), **ROOMY)
    grammar = 'root ::= "let me see" "\\n</think>\\n\\n" ("yes" | "no")'
    async with http(ep) as h:
        for stream in (False, True):
            text, final = await chat_text(h, stream=stream, grammar=grammar, max_tokens=32)
            if not stream:
                message = final["choices"][0]["message"]
                assert message["reasoning_content"] == "let me see"
                assert message["content"] in ("yes", "no")
            else:
                assert text in ("yes", "no")
        body = await chat(h, grammar=grammar, max_tokens=32, reasoning_format="none")
        message = body["choices"][0]["message"]
        assert "reasoning_content" not in message
        assert message["content"].startswith("let me see\n</think>")


async def test_a_cut_forced_call_is_never_content(engine: Any) -> None:
    """The length cap in the middle of forced calls, whole and streamed: the reply's whole calls
    only, finish_reason length, and no call syntax in content (issue 49)."""
    async with http(engine) as h:
        for max_tokens in range(4, 80, 5):
            body = await chat(h, tools=TOOLS, tool_choice="required", max_tokens=max_tokens)
            choice = body["choices"][0]
            assert not choice["message"].get("content"), (max_tokens, choice)
            assert choice["finish_reason"] in ("length", "tool_calls"), choice
            if choice["message"].get("tool_calls"):
                check_calls(choice["message"])
            events, done, _ = await stream_chat(h, tools=TOOLS, tool_choice="required", max_tokens=max_tokens)
            assert done  # [DONE]
            content, calls, finish = reassembled(events)
            assert content == "" and finish == choice["finish_reason"], (max_tokens, content)
            assert without_ids(calls) == without_ids(choice["message"].get("tool_calls") or [])
