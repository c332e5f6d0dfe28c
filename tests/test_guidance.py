"""A client's own GBNF runs on llguidance (engine/llama/grammar.py, GuidanceCache, issue 40): llama.cpp's
grammar engine has no bound on one token's work, and an ambiguous grammar held every stream
for minutes. Here: which engine a constraint gets, that llguidance constrains as the grammar
says, and that a grammar past the per-token bound ends its own request with a clear error
while another stream goes on and the engine stays healthy. (The time one such token takes is
measured by the hostile campaign's solo phase, not asserted here.)"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import trio

from helpers import MESSAGES, assert_server_healthy, chat, http
from hydra_trio.engine.chat import parse_constraint

# Ambiguous: every "a" may close either branch, so an Earley parser's items grow each token
# (llama.cpp's engine expanded its stacks for 265 s on one token of it).
AMBIGUOUS = 'root ::= s\ns ::= "a" s p | "a" s q | ""\np ::= "a"\nq ::= "a"\n'
YES_NO = 'root ::= "yes" | "no"'


def test_a_clients_gbnf_goes_to_llguidance_and_built_grammars_stay_on_llama() -> None:
    gbnf = parse_constraint({"grammar": YES_NO})
    assert gbnf is not None and gbnf.grammar_engine(()) == "llguidance"
    assert gbnf.grammar_engine(("a trigger",)) == "llama"  # a lazy grammar is llama.cpp's
    schema = parse_constraint({"json_schema": {"type": "integer"}})
    assert schema is not None and schema.grammar_engine(()) == "llama"


async def test_guidance_state_allows_what_the_grammar_allows(engine: Any) -> None:
    backend = engine.state.engine._core.backend
    guidance = backend.grammars.guidance
    await trio.to_thread.run_sync(guidance.compile, YES_NO)
    state = guidance.new_state(YES_NO)
    pieces = backend.pieces
    allowed = np.flatnonzero(state.allowed())
    assert len(allowed) and all(b"yes".startswith(pieces[t]) or b"no".startswith(pieces[t]) for t in allowed)
    y = next(t for t in allowed if pieces[t] and b"yes".startswith(pieces[t]))
    n = next(t for t in allowed if pieces[t] and b"no".startswith(pieces[t]))
    assert state.allows(y) and state.allows(n)
    state.accept(y)
    assert not state.allows(n)  # after "y...", only the rest of "yes"
    assert state.failure is None


async def test_an_ambiguous_grammar_ends_its_request_and_not_the_engine(start_engine: Any, tiny_model: Any) -> None:
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
