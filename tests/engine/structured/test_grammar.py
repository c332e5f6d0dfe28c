"""Constrained decoding (issue 30): response_format (json_object, json_schema), llama-server's
json_schema and GBNF grammar fields, on chat, completions and DECODE, with a live engine on
the synthetic tiny model. Its weights are random, so only what the grammar forces is
asserted: every constrained reply parses and validates against its schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from helpers import (
    ENGINE,
    MESSAGES,
    assert_server_healthy,
    chat,
    chat_text,
    decode,
    decode_ok,
    frame,
    get_result,
    http,
    object_schemas,
    rpc,
    sse_text,
    stream_chat,
)
from hydra_trio.rpc.client import build_decode_frame
from hydra_trio.wire import Status

YES_NO = 'root ::= "yes" | "no"'
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}  # a P/D router's, to the prefill engine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


async def test_gbnf_grammar_constrains_chat_and_completions(engine: Any) -> None:
    async with http(engine) as h:
        for seed_text in ("hello world", "tell me a story", "the cache server"):
            body = await chat(h, messages=[{"role": "user", "content": seed_text}], grammar=YES_NO, max_tokens=16)
            choice = body["choices"][0]
            assert choice["message"]["content"] in ("yes", "no")
            assert choice["finish_reason"] == "stop"
            r = await h.post("/v1/completions", json={"prompt": seed_text, "grammar": YES_NO, "max_tokens": 16})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] in ("yes", "no")


async def test_json_schema_reply_validates_chat_and_completions(engine: Any) -> None:
    async with http(engine) as h:
        bodies = [
            await chat(h, response_format=json_schema_format(PERSON), max_tokens=200),
            await chat(h, json_schema=PERSON, max_tokens=200),
        ]
        r = await h.post(
            "/v1/completions",
            json={"prompt": "a person:", "response_format": json_schema_format(PERSON), "max_tokens": 200},
        )
        assert r.status_code == 200, r.text
        texts = [b["choices"][0]["message"]["content"] for b in bodies] + [r.json()["choices"][0]["text"]]
        for body in [*bodies, r.json()]:
            assert body["choices"][0]["finish_reason"] == "stop"
        for text in texts:
            jsonschema.validate(json.loads(text), PERSON)


async def test_json_object_mode_gives_json(engine: Any) -> None:
    async with http(engine) as h:
        stopped = 0
        # Sampled, seeded: the random-weight model's greedy walk loops inside one key.
        for seed, content in enumerate(("hello world", "tell me a story", "the engine", "a cache", "slot")):
            body = await chat(
                h,
                messages=[{"role": "user", "content": content}],
                response_format={"type": "json_object"},
                max_tokens=300,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                min_p=0.0,
                seed=seed,
            )
            choice = body["choices"][0]
            if choice["finish_reason"] == "stop":
                stopped += 1
                assert isinstance(json.loads(choice["message"]["content"]), dict)
            else:  # cut by max_tokens: still the start of an object
                assert choice["message"]["content"].startswith("{")
        assert stopped > 0


@pytest.mark.parametrize("stream_interval", [1, 3])
async def test_stream_reassembles_to_the_reply(engine: Any, stream_interval: int) -> None:
    async with http(engine) as h:
        body = {"response_format": json_schema_format(PERSON), "max_tokens": 200, "stream_interval": stream_interval}
        whole = (await chat(h, **body))["choices"][0]["message"]["content"]
        chunks, done, _ = await stream_chat(h, **body)
        assert done
        assert sse_text(chunks) == whole
        jsonschema.validate(json.loads(whole), PERSON)


async def test_logprobs_are_the_constrained_distribution(engine: Any) -> None:
    async with http(engine) as h:
        body = await chat(h, grammar=YES_NO, max_tokens=8, logprobs=True, top_logprobs=5)
        content = body["choices"][0]["logprobs"]["content"]
        assert "".join(e["token"] for e in content) in ("yes", "no")
        # The first position allows only what starts "yes" or "no": every alternative does.
        first = content[0]
        assert first["top_logprobs"], first
        assert all(("yes".startswith(a["token"]) or "no".startswith(a["token"])) for a in first["top_logprobs"])
        assert sum(2.718281828 ** a["logprob"] for a in first["top_logprobs"]) <= 1.0 + 1e-6


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("grammar", "root ::= foo", "Rule 'foo' not found"),
        ("grammar", 'rot ::= "a"', "root"),
        ("grammar", 'root ::= "a', "end of input"),
        ("grammar", "root ::= " + "(" * 1001 + '"a"' + ")" * 1001, "nests"),
        ("grammar", 5, "must be a string"),
        # llguidance's GBNF reader drops the group's parentheses: still a 400, never a crash
        ("grammar", 'root ::= ("a"{0,1000}){0,1000}', "Expected value"),
        ("json_schema", {"type": "string", "minLength": 5, "maxLength": 2}, "no value can satisfy the schema"),
        # without strict, a schema llguidance cannot compile is relaxed whole
        # (tests/engine/structured/test_schema_keywords.py)
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {"$ref": "#/nope"}}},
            "does not exist",
        ),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {"type": "frob"}}},
            "not a JSON type",
        ),
        ("response_format", {"type": "xml"}, "not supported"),
        ("response_format", {"type": "json_schema"}, "json_schema must be an object"),
    ],
)
async def test_bad_constraint_is_400_naming_it(engine: Any, field: str, value: Any, says: str) -> None:
    async with http(engine) as h:
        r = await h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], field: value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["param"].startswith(field), err
        assert says in err["message"], err
        await assert_server_healthy(engine)
        assert engine.state.engine.stats().slots_busy == 0
        # And the engine still serves a constrained request.
        assert (await chat(h, grammar=YES_NO, max_tokens=8))["choices"][0]["message"]["content"] in ("yes", "no")


async def test_two_constraints_are_refused(engine: Any) -> None:
    async with http(engine) as h:
        r = await h.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "grammar": YES_NO, "json_schema": PERSON},
        )
        assert r.status_code == 400, r.text
        assert "send one" in r.json()["error"]["message"]


async def test_same_schema_compiles_once(engine: Any) -> None:
    grammars = engine.state.engine._core.inputs.grammars
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    async with http(engine) as h:
        before = grammars.compiles
        for _ in range(3):
            body = await chat(h, json_schema=schema, max_tokens=64)
            jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)
        assert grammars.compiles == before + 1


async def test_text_and_empty_constraints_ask_nothing(engine: Any) -> None:
    async with http(engine) as h:
        plain = (await chat(h, max_tokens=8))["choices"][0]["message"]["content"]
        for extra in ({"response_format": {"type": "text"}}, {"grammar": ""}, {"json_schema": {}}):
            assert (await chat(h, max_tokens=8, **extra))["choices"][0]["message"]["content"] == plain


# ---- the property: every constrained reply validates against its schema --------------------


async def test_property_every_constrained_reply_validates(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, slots=4)
    failures: list[tuple[dict[str, Any], str, str]] = []
    seen = 0

    async with http(ep) as h:

        @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @seed(30)
        @given(schema=object_schemas(), content=st.sampled_from(["hello world", "a story", "the model", "x"]))
        def collect(schema: dict[str, Any], content: str) -> None:
            cases.append((schema, content))

        cases: list[tuple[dict[str, Any], str]] = []
        collect()
        for schema, content in cases:
            for route in ("chat", "completions"):
                if route == "chat":
                    r = await h.post(
                        "/v1/chat/completions",
                        json={
                            "messages": [{"role": "user", "content": content}],
                            "response_format": json_schema_format(schema),
                            "max_tokens": 400,
                        },
                    )
                    body = r.json()
                    text = body["choices"][0]["message"]["content"]
                else:
                    # Sampled, not greedy: byte tokens and odd characters get drawn too.
                    r = await h.post(
                        "/v1/completions",
                        json={"prompt": content, "json_schema": schema, "max_tokens": 400, "temperature": 1.0,
                              "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": seen},
                    )
                    body = r.json()
                    text = body["choices"][0]["text"]
                assert r.status_code == 200, r.text
                seen += 1
                if body["choices"][0]["finish_reason"] != "stop":
                    failures.append((schema, text, "finish_reason " + body["choices"][0]["finish_reason"]))
                    continue
                try:
                    jsonschema.validate(json.loads(text), schema)
                except (ValueError, jsonschema.ValidationError) as exc:
                    failures.append((schema, text, str(exc)[:200]))
    assert seen >= 200
    assert not failures, failures[:3]


# ---- DECODE (0x43) and the P/D hand-off ------------------------------------------------------


@pytest.mark.parametrize("where", ["prompt", "generation"])
async def test_decode_carries_the_constraint(engine: Any, where: str) -> None:
    """The constraint in the DECODE's generation parameters: the prompt segment's keys or
    the header's ``generation`` object (docs/protocol-extensions.md)."""
    constraint = {"response_format": json_schema_format(PERSON)}
    async with await rpc(engine) as c, http(engine) as h:
        if where == "prompt":
            payload = frame(MESSAGES, n_predict=200, **constraint)
        else:
            payload = build_decode_frame(
                {"messages": MESSAGES, "n_predict": 200, "temperature": 0}, generation=constraint
            )
        rid = await decode_ok(c, 0, payload)
        body = await get_result(h, rid)
        assert body["choices"][0]["finish_reason"] == "stop"
        text = body["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(text), PERSON)
        # The same text as chat with the same schema (one rule, one grammar).
        assert (
            text
            == (await chat(h, response_format=json_schema_format(PERSON), max_tokens=200))["choices"][0]["message"][
                "content"
            ]
        )


async def test_decode_with_a_bad_grammar_is_refused_before_the_slot(engine: Any) -> None:
    async with await rpc(engine) as c:
        resp = await decode(c, 0, frame(MESSAGES, grammar="root ::= foo"))
        assert resp.status == Status.BAD_REQUEST, resp.meta
        assert "Rule 'foo' not found" in json.dumps(resp.meta)
        assert engine.state.engine.stats().slots_busy == 0
        rid = await decode_ok(c, 0, frame(MESSAGES, grammar=YES_NO))
    async with http(engine) as h:
        assert (await get_result(h, rid))["choices"][0]["message"]["content"] in ("yes", "no")


async def test_pd_handoff_with_a_schema_matches_one_engine(start_engine: Any, tiny_model_ctx: Path) -> None:
    """The prefill engine's one token obeys the grammar; the decode engine builds the same
    grammar from the request and samples the first token again from the carried logits, so
    the text is the one engine's."""
    a = await start_engine(tiny_model_ctx, **ENGINE)
    b = await start_engine(tiny_model_ctx, **ENGINE)
    body = {"messages": MESSAGES, "temperature": 0, "response_format": json_schema_format(PERSON)}
    async with http(a) as ca, http(b) as cb:
        reference = (await chat(ca, **body, max_tokens=200))["choices"][0]["message"]["content"]
        pre = await chat(ca, **body, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)
        assert reference.startswith(pre["choices"][0]["message"]["content"])
        for stream in (False, True):
            if stream:
                pre = await chat(ca, **body, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)
            text, final = await chat_text(
                cb, stream=stream, **body, max_tokens=200, kv_transfer_params=pre["kv_transfer_params"]
            )
            assert final["kv_transfer"]["status"] == "restored", final["kv_transfer"]
            assert text == reference
    jsonschema.validate(json.loads(reference), PERSON)


async def test_a_long_bounded_string_compiles_and_holds(engine: Any) -> None:
    """A maxLength of 100000 was a grammar nested 100k deep for llama.cpp's recursive parser
    (the process died, so it was refused); llguidance compiles it as a bounded regex."""
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 100000}},
        "required": ["s"],
        "additionalProperties": False,
    }
    async with http(engine) as h:
        body = await chat(h, messages=MESSAGES, response_format=json_schema_format(schema), max_tokens=200)
        if body["choices"][0]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)
        assert body["choices"][0]["message"]["content"].startswith("{")
    await assert_server_healthy(engine)


async def test_sampled_and_penalized_replies_follow_the_grammar(engine: Any) -> None:
    """Not only greedy: the chain's draw (top-k/p, temperature, penalties) under the grammar."""
    async with http(engine) as h:
        for s in range(6):
            body = await chat(
                h,
                response_format=json_schema_format(PERSON),
                max_tokens=200,
                temperature=1.5,
                top_k=0,
                top_p=1.0,
                min_p=0.0,
                seed=s,
            )
            assert body["choices"][0]["finish_reason"] == "stop"
            jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), PERSON)
            body = await chat(h, grammar=YES_NO, max_tokens=8, repeat_penalty=1.3, seed=s)
            assert body["choices"][0]["message"]["content"] in ("yes", "no")


async def test_grammar_end_wins_over_ignore_eos(engine: Any) -> None:
    async with http(engine) as h:
        body = await chat(h, grammar=YES_NO, max_tokens=16, ignore_eos=True)
        assert body["choices"][0]["message"]["content"] in ("yes", "no")
        assert body["choices"][0]["finish_reason"] == "stop"
        body = await chat(h, grammar=YES_NO, max_tokens=16, min_tokens=5)
        assert body["choices"][0]["message"]["content"] in ("yes", "no")


async def test_batched_slots_keep_their_own_grammars(start_engine: Any, tiny_model: Path) -> None:
    """Concurrent requests in one batch: each slot's grammar constrains only its request, and
    an unconstrained greedy reply is byte-identical to the same request alone."""
    import trio

    ep = await start_engine(tiny_model, slots=4)
    schemas = [
        PERSON,
        {
            "type": "object",
            "properties": {"xs": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
            "required": ["xs"],
            "additionalProperties": False,
        },
        {"type": "object", "properties": {"k": {"enum": ["red", "green", 7]}}, "required": ["k"],
         "additionalProperties": False},
    ]
    async with http(ep) as h:
        alone = (await chat(h, max_tokens=24))["choices"][0]["message"]["content"]
        results: dict[int, dict[str, Any]] = {}

        async def one(i: int) -> None:
            extra = {} if i == 3 else {"response_format": json_schema_format(schemas[i])}
            results[i] = await chat(h, max_tokens=24 if i == 3 else 200, **extra)

        for _ in range(2):
            async with trio.open_nursery() as n:
                for i in range(4):
                    n.start_soon(one, i)
            assert results[3]["choices"][0]["message"]["content"] == alone
            for i, schema in enumerate(schemas):
                assert results[i]["choices"][0]["finish_reason"] == "stop"
                jsonschema.validate(json.loads(results[i]["choices"][0]["message"]["content"]), schema)
