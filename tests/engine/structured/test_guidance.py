"""Every grammar runs on llguidance (engine/structured/guidance.py, issues 40 and 49):
llama.cpp's grammar engine has no bound on one token's work, and an ambiguous grammar held
every stream for minutes. Here: what each constraint becomes, that llguidance constrains as
the grammar says, and that a grammar past the per-token bound ends its own request with a
clear error while another stream goes on and the engine stays healthy. (The time one such
token takes is measured by the hostile campaign's solo phase, not asserted here.)"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import trio

from helpers import MESSAGES, assert_server_healthy, chat, http
from hydra_trio.engine.chat import constraint_grammar
from hydra_trio.engine.chat.formats import GENERIC
from hydra_trio.engine.structured import OutputGrammar, output_constraint
from hydra_trio.engine.structured import guidance as guidance_module

# Ambiguous: every "a" may close either branch, so an Earley parser's items grow each token
# (llama.cpp's engine expanded its stacks for 265 s on one token of it).
AMBIGUOUS = 'root ::= s\ns ::= "a" s p | "a" s q | ""\np ::= "a"\nq ::= "a"\n'
YES_NO = 'root ::= "yes" | "no"'


def test_a_clients_gbnf_is_its_own_text_and_schemas_are_lark() -> None:
    gbnf = output_constraint({"grammar": YES_NO})
    assert gbnf is not None
    grammar = constraint_grammar(gbnf, GENERIC)
    assert grammar.syntax == "gbnf" and grammar.text == YES_NO and grammar.param == "grammar"
    schema = output_constraint({"json_schema": {"type": "integer"}})
    assert schema is not None
    lark = constraint_grammar(schema, GENERIC)
    assert lark.syntax == "lark" and lark.text.startswith("start: %json ")


async def test_guidance_state_allows_what_the_grammar_allows(engine: Any) -> None:
    backend = engine.state.engine._core.backend
    guidance = engine.state.engine._core.inputs.grammars
    grammar = OutputGrammar(YES_NO, "gbnf")
    await trio.to_thread.run_sync(guidance.compile, grammar)
    state = guidance.new_state(grammar)
    pieces = backend.pieces
    allowed = np.flatnonzero(state.allowed())
    assert len(allowed) and all(b"yes".startswith(pieces[t]) or b"no".startswith(pieces[t]) for t in allowed)
    y = next(t for t in allowed if pieces[t] and b"yes".startswith(pieces[t]))
    n = next(t for t in allowed if pieces[t] and b"no".startswith(pieces[t]))
    assert state.allows(y) and state.allows(n)
    state.accept(y)
    assert not state.allows(n)  # after "y...", only the rest of "yes"
    assert state.failure is None


async def test_an_ambiguous_grammar_ends_its_request_and_not_the_engine(
    start_engine: Any, tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the per-token bound the request ends with a 400 (streamed: an error event). The
    bound is lowered here so that the tiny vocabulary's ambiguous grammar reaches it within
    a slot's context (with the engine's own bound it needs more tokens than a slot holds)."""
    monkeypatch.setattr(guidance_module, "LIMITS", {**guidance_module.LIMITS, "step_max_items": 2_000})
    ep = await start_engine(tiny_model, slots=2)
    body = {"messages": MESSAGES, "grammar": AMBIGUOUS, "max_tokens": 1800, "min_tokens": 1800}
    async with http(ep) as h:
        results: dict[str, Any] = {}

        async def wedge() -> None:
            results["wedge"] = await h.post("/v1/chat/completions", json=body)

        async def beside() -> None:
            results["beside"] = await chat(h, max_tokens=64, ignore_eos=True)

        async with trio.open_nursery() as n:
            n.start_soon(wedge)
            n.start_soon(beside)
        r = results["wedge"]
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "grammar"
        assert "too complex" in error["message"] and "\n" not in error["message"]
        assert results["beside"]["usage"]["completion_tokens"] == 64  # the other stream went on
        # Streamed, the reply ends with an error event after the tokens it did send.
        async with h.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            lines = [line async for line in s.aiter_lines()]
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert any(e.get("choices") for e in events) and "too complex" in events[-1]["error"]["message"]
        # The engine is healthy: a constrained and a plain request answer.
        assert (await chat(h, grammar=YES_NO, max_tokens=8))["choices"][0]["message"]["content"] in ("yes", "no")
    await assert_server_healthy(ep)


# 20,000 alternatives, ~210 KB: llama.cpp's parse of it holds its caller ~1 s (the worker, so
# every stream) and one token's pass over the vocabulary took minutes; llguidance compiles it
# off the worker and masks a token in milliseconds.
WIDE = "root ::= " + " | ".join(f'"w{i}"' for i in range(20_000)) + "\n"


async def test_a_large_client_grammar_is_compiled_off_the_worker(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its compile runs while the GPU worker is free for every stream's steps."""
    worker = engine.state.engine._core.worker
    seen: list[bool] = []
    real = guidance_module.GuidanceCache.compile

    def spy(self: Any, grammar: Any) -> None:
        seen.append(worker.limiter.borrowed_tokens == 0)
        real(self, grammar)

    monkeypatch.setattr(guidance_module.GuidanceCache, "compile", spy)
    async with http(engine) as h:
        body = await chat(h, grammar=WIDE, max_tokens=16)
    content = body["choices"][0]["message"]["content"]
    assert content.startswith("w") and content[1:].isdigit() and int(content[1:]) < 20_000
    assert seen == [True]


async def test_gbnf_llguidance_cannot_run_is_a_400_naming_it(engine: Any) -> None:
    """A repetition of a bracketed repetition: llama.cpp reads it, llguidance's converter does
    not (it drops the brackets). Refused, not run on the engine that cannot bound it."""
    async with http(engine) as h:
        r = await h.post("/v1/chat/completions", json={"messages": MESSAGES, "grammar": 'root ::= ("a"{0,3}){0,3}'})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "grammar" and "llguidance" in error["message"], error
        assert (await chat(h, grammar=YES_NO, max_tokens=8))["choices"][0]["message"]["content"] in ("yes", "no")
