"""Thinking controls: reasoning_effort reaching the template, the thinking budget
(--reasoning-budget, a request's reasoning_budget_tokens, Anthropic's thinking.budget_tokens)
forcing the close tag as real tokens, and a grammar held until the think block closes.

Random weights never close a think block by themselves in a few tokens, so the budget is what
makes the close happen: the tests are deterministic (greedy) either way."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from helpers import chat, chat_plan, http
from hydra_trio.config import Settings, add_arguments, settings_from
from hydra_trio.engine.chat import render_jinja
from hydra_trio.engine.requests import check_request
from hydra_trio.engine.structured import ThinkGate, ThinkPlan
from hydra_trio.http.messages import to_chat as messages_to_chat
from hydra_trio.http.plumbing import HttpError
from hydra_trio.http.responses import to_chat as responses_to_chat
from hydra_trio.wire.errors import ParamError

ROOMY = {"ctx_size": 4096}
USER = [{"role": "user", "content": "hello world"}]
# DeepSeek-R1's way: the generation prompt opens the think block.
OPENS_THINK = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
# Qwen3's way: the model opens the block itself; enable_thinking false renders it closed.
MAY_THINK = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}


# ---- reasoning_effort --------------------------------------------------------------------


def test_reasoning_effort_is_accepted_and_a_bad_value_is_refused_naming_it() -> None:
    for effort in ("none", "minimal", "low", "medium", "high"):
        check_request("chat", {"messages": USER, "reasoning_effort": effort})
    for bad in ("extreme", 3, ["low"]):
        with pytest.raises(ParamError) as exc:
            check_request("chat", {"messages": USER, "reasoning_effort": bad})
        assert exc.value.param == "reasoning_effort" and "minimal" in str(exc.value)
    # On a plain prompt there is no template to think: refused, as the other chat parameters.
    for key, value in (("reasoning_effort", "low"), ("reasoning_budget_tokens", 8), ("thinking_budget_tokens", 0)):
        with pytest.raises(ParamError) as exc:
            check_request("completions", {"prompt": "hi", key: value})
        assert exc.value.param == key
    check_request("completions", {"prompt": "hi", "reasoning_budget_tokens": -1})


def test_reasoning_effort_reaches_the_template() -> None:
    """gpt-oss's template reads reasoning_effort; "none" turns thinking off instead."""
    source = "{{ reasoning_effort | default('unset') }}/{{ enable_thinking }}"
    kw: dict[str, Any] = {"bos_token": "", "eos_token": ""}
    assert render_jinja({"messages": USER, "reasoning_effort": "high"}, source, **kw).startswith("high/")
    assert render_jinja({"messages": USER, "reasoning_effort": "none"}, source, **kw) == "unset/False"
    assert (
        render_jinja(
            {"messages": USER, "reasoning_budget_tokens": 0, "chat_template_kwargs": {"enable_thinking": True}},
            source,
            **kw,
        )
        == "unset/False"
    )


def test_responses_reasoning_effort_passes_through() -> None:
    body = {"input": "hi", "reasoning": {"effort": "low"}}
    chat_body = responses_to_chat(body)
    assert chat_body["reasoning_effort"] == "low" and chat_body["chat_template_kwargs"] == {"enable_thinking": True}
    with pytest.raises(HttpError) as exc:
        responses_to_chat({"input": "hi", "reasoning": {"effort": "huge"}})
    assert exc.value.status == 400


def test_anthropic_thinking_budget_maps_to_the_request_budget() -> None:
    body = {"model": "m", "max_tokens": 9, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 5}}
    assert messages_to_chat(body)["reasoning_budget_tokens"] == 5
    with pytest.raises(HttpError):
        messages_to_chat({**body, "thinking": {"type": "enabled", "budget_tokens": "lots"}})


# ---- the flag ----------------------------------------------------------------------------


def test_reasoning_budget_flag_parses_and_a_bad_value_stops_the_start() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from(parser.parse_args(["--reasoning-budget", "64"]), env={}).reasoning_budget == 64
    assert Settings().reasoning_budget == -1
    with pytest.raises(SystemExit, match="reasoning_budget must be -1"):
        settings_from(parser.parse_args(["--reasoning-budget", "-2"]), env={})
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--reasoning-budget", "lots"])
    assert exc.value.code != 0
    with pytest.raises(SystemExit, match="HYDRA_REASONING_BUDGET"):
        settings_from(None, env={"HYDRA_REASONING_BUDGET": "many"})


# ---- the gate, alone ---------------------------------------------------------------------

PIECES = {1: b"<think>", 2: b"a", 3: b"</", 4: b"think>", 5: b"\n", 6: b"\xc3", 7: b"\xa9"}
PLAN = ThinkPlan(open_text=b"<think>", close_text=b"</think>", open_tokens=(1,), close_tokens=(3, 4))


def _run(gate: ThinkGate, model: list[int]) -> list[int]:
    """What the gate makes of the model's picks: a forced token replaces the model's pick."""
    out, picks = [], iter(model)
    while len(out) < 12:
        forced = gate.forced()
        token = forced if forced is not None else next(picks, None)
        if token is None:
            break
        gate.accept(token)
        out.append(token)
    return out


def test_a_budget_forces_the_close_tag_after_n_reasoning_tokens() -> None:
    from dataclasses import replace

    gate = ThinkGate(replace(PLAN, budget=3, starts_in_reasoning=True), PIECES.__getitem__)
    assert _run(gate, [2] * 8)[:6] == [2, 2, 2, 3, 4, 2] and gate.state == "done" and gate.n_reasoning == 3
    # A character cut in two is finished first; the model's own close ends the block.
    gate = ThinkGate(replace(PLAN, budget=1, starts_in_reasoning=True), PIECES.__getitem__)
    assert _run(gate, [6, 7, 2])[:4] == [6, 7, 3, 4]
    gate = ThinkGate(replace(PLAN, budget=9, starts_in_reasoning=True), PIECES.__getitem__)
    assert _run(gate, [2, 3, 4, 2]) == [2, 3, 4, 2] and gate.state == "done"
    # Budget 0: the block closes at once; before the block nothing is counted.
    assert _run(ThinkGate(replace(PLAN, budget=0, starts_in_reasoning=True), PIECES.__getitem__), [2]) == [3, 4, 2]
    gate = ThinkGate(replace(PLAN, budget=1), PIECES.__getitem__)
    assert _run(gate, [2, 5, 1, 2, 2]) == [2, 5, 1, 2, 3, 4, 2]


def test_a_held_grammar_waits_for_the_close_and_an_end_inside_becomes_the_close() -> None:
    from dataclasses import replace

    gate = ThinkGate(replace(PLAN, force_open=True, holds_grammar=True), PIECES.__getitem__)
    assert gate.holds_grammar and gate.forced() == 1
    gate.accept(1)
    assert gate.state == "think" and gate.forced() is None
    assert gate.close_instead() == 3  # an end of generation picked inside the block
    gate.accept(3)
    gate.accept(4)
    assert gate.state == "done" and not gate.holds_grammar


# ---- through the engine ------------------------------------------------------------------


def _tokens(body: dict[str, Any]) -> list[str]:
    return [t["token"] for t in body["choices"][0]["logprobs"]["content"]]


def _before_close(tokens: list[str]) -> int:
    """How many tokens come before the one that starts ``</think>``."""
    text = ""
    for i, tok in enumerate(tokens):
        text += tok
        if "</think>" in text:
            start = text.index("</think>")
            n = 0
            for j in range(i + 1):
                n += len(tokens[j])
                if n > start:
                    return j
    raise AssertionError(f"no </think> in {tokens!r}")


async def test_a_budget_ends_the_reasoning_and_the_reply_goes_on(
    start_engine: Any, tiny_model: Path, tmp_path: Path
) -> None:
    template = tmp_path / "think.jinja"
    template.write_text(OPENS_THINK)
    ep = await start_engine(tiny_model, chat_template_file=str(template), reasoning_budget=6, **ROOMY)
    async with http(ep) as h:
        for field, budget in (("reasoning_budget_tokens", 4), ("thinking_budget_tokens", 2), (None, 6)):
            extra = {field: budget} if field else {}
            raw = await chat(
                h, messages=USER, max_tokens=16, temperature=0, logprobs=True, reasoning_format="none", **extra
            )
            tokens = _tokens(raw)
            assert _before_close(tokens) == budget, tokens
            assert raw["usage"]["completion_tokens"] == len(tokens) == 16  # the forced tokens are generated ones
            split = await chat(h, messages=USER, max_tokens=16, temperature=0, **extra)
            message = split["choices"][0]["message"]
            assert message["reasoning_content"] and message["content"], message
            assert message["reasoning_content"] + "</think>" in raw["choices"][0]["message"]["content"]
        r = await h.post("/v1/chat/completions", json={"messages": USER, "reasoning_budget_tokens": -3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_budget_tokens"


async def test_a_json_schema_starts_after_the_reasoning(start_engine: Any, tiny_model: Path, tmp_path: Path) -> None:
    """Both ways a reply thinks: the prompt opened the block, or the template thinks and
    thinking is on (the engine opens the block). Either way the reasoning comes first and the
    content follows the schema; with thinking off the grammar holds from the first token."""
    for source, kwargs in ((OPENS_THINK, {}), (MAY_THINK, {"chat_template_kwargs": {"enable_thinking": True}})):
        template = tmp_path / "t.jinja"
        template.write_text(source)
        ep = await start_engine(tiny_model, chat_template_file=str(template), **ROOMY)
        async with http(ep) as h:
            for stream in (False, True):
                body = {"messages": USER, "max_tokens": 64, "temperature": 0, "response_format": RESPONSE_FORMAT,
                        "reasoning_budget_tokens": 5, **kwargs}
                if not stream:
                    message = (await chat(h, **body))["choices"][0]["message"]
                    reasoning, content = message["reasoning_content"], message["content"]
                else:
                    reasoning, content = await _streamed(h, body)
                assert reasoning, (source, stream)
                jsonschema.validate(json.loads(content), SCHEMA)
            if source is OPENS_THINK:  # no budget: random weights think until max_tokens
                unlimited = (await chat(h, messages=USER, max_tokens=12, temperature=0))["choices"][0]["message"]
                assert unlimited["reasoning_content"] and not unlimited["content"]
            if source is MAY_THINK:
                off = (await chat(h, messages=USER, max_tokens=64, temperature=0, response_format=RESPONSE_FORMAT,
                                  chat_template_kwargs={"enable_thinking": False}))["choices"][0]["message"]
                assert not off.get("reasoning_content")
                jsonschema.validate(json.loads(off["content"]), SCHEMA)


async def _streamed(h: Any, body: dict[str, Any]) -> tuple[str, str]:
    reasoning = content = ""
    async with h.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    delta = choice.get("delta", {})
                    reasoning += delta.get("reasoning_content") or ""
                    content += delta.get("content") or ""
    return reasoning, content


async def test_messages_thinking_budget_gives_a_thinking_block_then_text(
    start_engine: Any, tiny_model: Path, tmp_path: Path
) -> None:
    template = tmp_path / "think.jinja"
    template.write_text(OPENS_THINK)
    ep = await start_engine(tiny_model, chat_template_file=str(template), reasoning_budget=3, **ROOMY)
    async with http(ep) as h:
        r = await h.post("/v1/messages", json={
            "model": "m", "max_tokens": 48, "messages": USER, "temperature": 0,
            "thinking": {"type": "enabled", "budget_tokens": 2},  # wins over --reasoning-budget
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
        })
        assert r.status_code == 200, r.text
        blocks = r.json()["content"]
        assert [b["type"] for b in blocks] == ["thinking", "text"], blocks
        jsonschema.validate(json.loads(blocks[1]["text"]), SCHEMA)
        r = await h.post("/v1/responses", json={
            "model": "m", "max_output_tokens": 48, "input": "hello world", "temperature": 0,
            "reasoning": {"effort": "low"},  # the budget: --reasoning-budget
            "text": {"format": {"type": "json_schema", "name": "r", "schema": SCHEMA}},
        })
        assert r.status_code == 200, r.text
        items = r.json()["output"]
        assert [i["type"] for i in items] == ["reasoning", "message"], items
        jsonschema.validate(json.loads(items[1]["content"][0]["text"]), SCHEMA)


async def test_reasoning_effort_over_http(start_engine: Any, tiny_model: Path, tmp_path: Path) -> None:
    template = tmp_path / "effort.jinja"
    template.write_text(OPENS_THINK.replace("<think>\n", "<think>effort={{ reasoning_effort | default('unset') }}\n"))
    ep = await start_engine(tiny_model, chat_template_file=str(template), **ROOMY)
    async with http(ep) as h:
        prompt = (await h.post("/apply-template", json={"messages": USER, "reasoning_effort": "high"})).json()["prompt"]
        assert "effort=high" in prompt
        await chat(h, messages=USER, max_tokens=2, reasoning_effort="low")
        r = await h.post("/v1/chat/completions", json={"messages": USER, "reasoning_effort": "extreme"})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "reasoning_effort" and error["type"] == "invalid_request_error"


async def test_a_forced_tool_call_comes_after_the_reasoning(
    start_engine: Any, tiny_model: Path, tmp_path: Path
) -> None:
    template = tmp_path / "think.jinja"
    template.write_text(OPENS_THINK)
    ep = await start_engine(tiny_model, chat_template_file=str(template), **ROOMY)
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
    async with http(ep) as h:
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            body = await chat(h, messages=USER, max_tokens=96, temperature=0, tools=[tool], tool_choice=choice,
                              reasoning_budget_tokens=4)
            message = body["choices"][0]["message"]
            assert message["reasoning_content"], message
            calls = message["tool_calls"]
            assert calls and calls[0]["function"]["name"] == "get_time", message
            assert json.loads(calls[0]["function"]["arguments"])["zone"] in ("UTC", "CET")


def test_which_replies_get_a_think_plan() -> None:
    """The one decision (``Chat.plan``'s think block): a budget where the reply thinks, a
    grammar held where it thinks first, and nothing where it does not."""
    from hydra_trio.engine.chat import Chat, ChatTemplate

    def plan(source: str, *, budget: int = -1, **req: Any) -> ThinkPlan | None:
        chat_ = Chat(
            ChatTemplate(name="t", source="inline", jinja=source),
            tool_call_parser="auto",
            reasoning_format="auto",
            bos_token="",
            eos_token="",
            tokenizer_adds_bos=False,
            run_on_worker=None,
            apply_builtin=None,
        )  # type: ignore[arg-type]
        return chat_plan(chat_, {"messages": USER, "reasoning_budget_tokens": budget, **req}, budget=budget).think

    json_gbnf = {"grammar": 'root ::= "{}"'}
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    auto = {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "auto",
    }
    assert plan(OPENS_THINK) is None
    p = plan(OPENS_THINK, budget=3)
    assert p is not None and p.starts_in_reasoning and p.budget == 3 and not p.holds_grammar and not p.force_open
    p = plan(OPENS_THINK, **json_gbnf)
    assert p is not None and p.holds_grammar and p.budget == -1
    assert plan(OPENS_THINK, grammar='root ::= "a</think>b"') is None  # it spells the reasoning itself
    p = plan(MAY_THINK, **json_gbnf, **on)
    assert p is not None and p.force_open and p.holds_grammar and not p.starts_in_reasoning
    assert plan(MAY_THINK, **json_gbnf, chat_template_kwargs={"enable_thinking": False}) is None
    assert plan(MAY_THINK, **json_gbnf, reasoning_effort="none", **on) is None
    assert plan(MAY_THINK, **auto, **on) is None  # tool_choice auto: may call at once
    p = plan(MAY_THINK, budget=5, **on)
    # the model opens the block, the budget counts from there
    assert p is not None and not p.force_open and p.budget == 5
    chatml = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert plan(chatml, **json_gbnf, budget=5) is None


async def test_pd_handoff_thinks_as_one_engine(start_engine: Any, tiny_model: Path, tmp_path: Path) -> None:
    """The decode side samples the first token from the handed logits with its own sampler:
    the budget and the held grammar give the reply one engine gives."""
    template = tmp_path / "think.jinja"
    template.write_text(MAY_THINK)
    a = await start_engine(tiny_model, chat_template_file=str(template), **ROOMY)
    b = await start_engine(tiny_model, chat_template_file=str(template), **ROOMY)
    body = {"messages": USER, "temperature": 0, "response_format": RESPONSE_FORMAT, "reasoning_budget_tokens": 3,
            "chat_template_kwargs": {"enable_thinking": True}}
    async with http(a) as ca, http(b) as cb:
        reference = (await chat(ca, **body, max_tokens=64))["choices"][0]["message"]
        pre = await chat(
            ca, **body, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False}
        )
        r = await cb.post(
            "/v1/chat/completions", json={**body, "max_tokens": 64, "kv_transfer_params": pre["kv_transfer_params"]}
        )
        assert r.status_code == 200, r.text
        handed = r.json()
        assert handed["kv_transfer"]["status"] == "restored", handed["kv_transfer"]
    message = handed["choices"][0]["message"]
    assert message == reference and message["reasoning_content"]
    jsonschema.validate(json.loads(message["content"]), SCHEMA)


async def test_a_budget_of_zero_turns_thinking_off(start_engine: Any, tiny_model: Path, tmp_path: Path) -> None:
    """--reasoning-budget 0: the template renders with thinking off; one that opens the block
    anyway (it reads no switch) has it closed at once, so the reply is all content."""
    for source in (MAY_THINK, OPENS_THINK):
        template = tmp_path / "t.jinja"
        template.write_text(source)
        ep = await start_engine(tiny_model, chat_template_file=str(template), reasoning_budget=0, **ROOMY)
        async with http(ep) as h:
            kw = {"chat_template_kwargs": {"enable_thinking": True}}
            prompt = (
                await h.post("/apply-template", json={"messages": USER, "reasoning_budget_tokens": 0, **kw})
            ).json()["prompt"]
            assert prompt.endswith("</think>\n\n") if source is MAY_THINK else prompt.endswith("<think>\n")
            raw = await chat(h, messages=USER, max_tokens=16, temperature=0, reasoning_format="none", **kw)
            message = (await chat(h, messages=USER, max_tokens=16, temperature=0, **kw))["choices"][0]["message"]
            assert not message.get("reasoning_content") and message["content"], message
            if source is OPENS_THINK:
                assert raw["choices"][0]["message"]["content"].startswith("</think>")
