"""Tool-call grammars at the engine level (no HTTP): on the random-weight tiny model, a reply
under tool_choice "required" or a named function, greedy and sampled, is always calls of a
declared tool whose arguments validate against its parameters, in every format; "auto" is a
lazy grammar that waits for its trigger, however many tokens the trigger takes."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import family_examples
from helpers import object_schemas
from hydra_trio.engine import SamplingParams
from hydra_trio.engine.chat import ToolRequest, parse_reply, parse_tools
from hydra_trio.engine.chat.call_grammar import tool_triggers, tools_grammar
from hydra_trio.engine.chat.families import ToolFormat, Trigger
from hydra_trio.engine.chat.formats import FORMATS, GENERIC
from hydra_trio.engine.sample import Sampler
from hydra_trio.wire.errors import ParamError

HERMES = FORMATS["hermes"]
SAMPLED = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
MAX_TOKENS = 3000  # Hy3 writes its long tags in many tokens here: 8 parallel calls can pass 1500


async def _discard(_text: str) -> None:
    return None


async def generate(engine: Any, body: dict[str, Any], prompt: str = "call a tool") -> tuple[str, str]:
    """(text, stop_type) of one generation through the engine's own path."""
    prepared = await engine.prepare("chat", {**body, "messages": [{"role": "user", "content": prompt}]})
    assert prepared.tokens is not None
    async with engine.claim("test", prompt=prepared.tokens) as lease:
        res = await lease.generate(prepared.tokens, prepared.params, _discard)
    return res.text, res.stop_type


def tools_body(schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": s}} for i, s in enumerate(schemas)]


def check_calls(text: str, fmt: ToolFormat, req: ToolRequest, *, exactly_one: bool) -> None:
    reply = parse_reply(text, fmt, parse_tools=True, reasoning=False, tools=req)
    assert reply.tool_calls, (fmt.name, text)
    assert reply.content == "", (fmt.name, text)
    if exactly_one:
        assert len(reply.tool_calls) == 1, text
    for call in reply.tool_calls:
        tool = req.tool(call.name)
        assert tool is not None and tool in req.callable, call
        jsonschema.validate(json.loads(call.arguments), tool.parameters)


def use_format(engine: Any, fmt: ToolFormat) -> None:
    """Serve ``fmt`` as if the template wrote calls so (a white-box switch of the chat caps)."""
    served = engine._core.inputs.chat._default  # the template served to requests (no tool_use variant here)
    served.caps = dataclasses.replace(served.caps, tool_format=fmt)


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
async def test_required_and_named_calls_validate_in_every_format(
    start_engine: Any, tiny_model: Path, fmt: ToolFormat
) -> None:
    ep = await start_engine(tiny_model, slots=1)
    engine = ep.state.engine
    cases: list[tuple[list[dict[str, Any]], Any, bool]] = []

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @seed(31)
    @given(
        schemas=st.lists(object_schemas(), min_size=1, max_size=3),
        named=st.booleans(),
        parallel=st.booleans(),
    )
    def collect(schemas: list[dict[str, Any]], named: bool, parallel: bool) -> None:
        choice = {"type": "function", "function": {"name": f"tool_{len(schemas) - 1}"}} if named else "required"
        cases.append((schemas, choice, parallel))

    collect()
    seen = 0
    use_format(engine, fmt)
    for n, (schemas, choice, parallel) in enumerate(cases):
        body = {
            "tools": tools_body(schemas),
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
            "max_tokens": MAX_TOKENS,
        }
        req = parse_tools(body)
        assert req is not None
        for sampling in ({"temperature": 0}, {**SAMPLED, "seed": n}):
            text, stop = await generate(engine, {**body, **sampling})
            assert stop == "eos", (fmt.name, text)
            check_calls(text, fmt, req, exactly_one=not parallel)
            if choice != "required":
                assert {c.name for c in parse_reply(text, fmt, parse_tools=True, reasoning=False).tool_calls} == {
                    req.function
                }
            seen += 1
    assert seen == 2 * len(cases)


async def test_each_format_starts_with_its_syntax(engine: Any) -> None:
    eng = engine.state.engine
    body = {"tools": tools_body([{"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}]),
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200}
    starts = {"hermes": '<tool_call>\n{"name": "tool_0", "arguments": ', "llama3": '{"name": "tool_0", "parameters": ',
              "mistral": '[TOOL_CALLS][{"name": "tool_0", "arguments": ',
              "generic": '{"tool_calls": [{"name": "tool_0", "arguments": ',
              "qwen3_coder": "<tool_call>\n<function=tool_0>\n<parameter=x>\n",
              "seed_oss": "<seed:tool_call>\n<function=tool_0>\n<parameter=x>\n",
              "glm": "<tool_call>tool_0\n<arg_key>x</arg_key>\n<arg_value>",
              "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.tool_0:",
              "deepseek": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_0<｜tool▁sep｜>",
              "deepseek_dsml": '<｜DSML｜function_calls>\n<｜DSML｜invoke name="tool_0">\n'
              '<｜DSML｜parameter name="x" string="false">',
              "minimax": '<minimax:tool_call>\n<invoke name="tool_0">\n<parameter name="x">',
              "gemma4": "<|tool_call>call:tool_0{x:",
              "granite": '<|tool_call|>[{"name": "tool_0", "arguments": ',
              "nemotron": '<TOOLCALL>[{"name": "tool_0", "arguments": ',
              "apriel": '<tool_calls>[{"name": "tool_0", "arguments": ',
              "cohere": '<|START_ACTION|>[\n    {"tool_call_id": "',  # then the model's id, the name, the parameters
              "firefunction": 'functools[{"name": "tool_0", "arguments": ',
              "minimax_m1": '<tool_calls>\n{"name": "tool_0", "arguments": ',
              "apertus": '<|tools_prefix|>[{"tool_0": ',
              "gigachat3": '<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "tool_0", "arguments": ',
              "gigachat3_1": '<|function_call|>{"name": "tool_0", "arguments": ',
              "minicpm5": '<function name="tool_0"><param name="x">',
              "functionary": "tool_0\n",  # the prompt ends with its ">>>" (which the grammar may repeat)
              "solar": "<|tool_calls|><|tool_call:begin|>",  # then the model's id, the name, the arguments
              "mistral_args": "[TOOL_CALLS]tool_0[ARGS]{",  # then the arguments' JSON, spaced as it goes
              "mistral_call_id": "[TOOL_CALLS]tool_0[CALL_ID]",  # then the model's id, the arguments
              "kimi_k3": '<|open|>tools<|sep|><|open|>call tool="tool_0" index="',
              "command_r_plus": 'Action:\n```json\n[\n    {"tool_name": "tool_0", "parameters": ',
              "lfm2": "<|tool_call_start|>[tool_0(x=",
              "hy3": "<tool_calls:opensource>\n<tool_call:opensource>tool_0<tool_sep:opensource>\n<arg_key:opensource>x"
                     "</arg_key:opensource>\n<arg_value:opensource>",
              "harmony": "<|channel|>commentary to=functions.tool_0 <|constrain|>json<|message|>",
              "muse_glimmer": ' to=tool_0<|message|><atem:function_calls>\n<atem:invoke name="tool_0">\n'
              '<atem:parameter name="x">'}
    for name, fmt in FORMATS.items():
        if name not in starts:  # a family added since: what its own writer puts before the value
            written = family_examples.write_calls(fmt, [("tool_0", {"x": True})], lambda _n, _k, v: json.dumps(v))
            assert written is not None, f"{name}: no writer of its calls (family_examples.py)"
            starts[name] = written[: written.index("true")]
        use_format(eng, fmt)
        text, _ = await generate(eng, body)
        # llama3's <|python_tag|> is optional: the reply may or may not carry it.
        assert text.removeprefix("<|python_tag|>").removeprefix(">>>").startswith(starts[name]), (name, text)
        if name == "cohere":
            assert re.match(r'\d{1,3}", "tool_name": "tool_0", "parameters": ', text[len(starts[name]):]), text
        if name == "kimi_k3":
            assert re.match(r'[1-9][0-9]?"<\|sep\|><\|open\|>argument key="x" '
                            r'type="boolean"<\|sep\|>', text[len(starts[name]):]), text
        if name == "solar":
            assert re.match(r"\d{1,3}<\|tool_call:name\|>tool_0<\|tool_call:args\|>", text[len(starts[name]):]), text
        if name == "mistral_call_id":  # the 9 characters its template demands of an id
            assert re.match(r"[a-zA-Z0-9]{9}\[ARGS\]\{", text[len(starts[name]):]), text


async def test_auto_is_a_lazy_grammar_compiled_once(engine: Any) -> None:
    eng = engine.state.engine
    grammars = eng._core.inputs.grammars
    use_format(eng, HERMES)
    body = {"tools": tools_body([{"type": "object", "properties": {"n": {"type": "integer"}}}]), "max_tokens": 24}
    messages = [{"role": "user", "content": "call a tool"}]
    grammar = (await eng.prepare("chat", {**body, "messages": messages})).params.sampling.grammar
    assert grammar is not None and grammar.triggers
    before = grammars.compiles
    free = [await generate(eng, body) for _ in range(2)]
    assert grammars.compiles == before  # compiled once, by the first prepare
    assert grammars.known(grammar)
    # The same calls forced: the same grammar text (laziness is the engine's), compiled already.
    forced = (
        await eng.prepare("chat", {**body, "tool_choice": "required", "messages": messages})
    ).params.sampling.grammar
    assert forced is not None and forced.text == grammar.text and not forced.triggers
    assert grammars.compiles == before
    # Untriggered, the lazy grammar constrains nothing: this model writes no trigger, so the
    # reply is free text.
    assert free[0] == free[1] and free[0][1] == "limit"
    assert "<tool_call>" not in free[0][0]
    reply = parse_reply(free[0][0], HERMES, parse_tools=True, reasoning=False, tools=parse_tools(body))
    assert reply.content == free[0][0] and reply.tool_calls == []


# DeepSeek's markers hold U+2581, which this SentencePiece vocabulary reads as its space
# piece: the trigger cannot be written token by token here (its grammar still holds: the
# required-call test writes the marker in byte tokens).
OK_TOOL = parse_tools(
    {"tools": tools_body([{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}])}
)
assert OK_TOOL is not None


def all_triggers(fmt: ToolFormat) -> tuple[Trigger, ...]:
    """The format's triggers and its per-tool ones for ``tool_0`` (Muse Glimmer's)."""
    return (*fmt.triggers, *tool_triggers(fmt, OK_TOOL))  # type: ignore[arg-type]


TRIGGERS = [
    (name, i) for name, fmt in FORMATS.items() for i, t in enumerate(all_triggers(fmt)) if "\u2581" not in t.text
]


@pytest.mark.parametrize(("fmt_name", "which"), TRIGGERS, ids=[f"{n}-{i}" for n, i in TRIGGERS])
async def test_a_lazy_grammar_triggers_on_a_trigger_written_over_several_tokens(
    engine: Any, fmt_name: str, which: int
) -> None:
    """Drive a Sampler token by token (logits that favour one token each time): free text
    first, then the trigger, a piece at a time; from then on the grammar holds, so a token
    it refuses is replaced by one it allows."""
    eng = engine.state.engine
    backend = eng._core.backend
    fmt = FORMATS[fmt_name]
    grammar = tools_grammar(OK_TOOL, fmt)  # type: ignore[arg-type]
    grammars = eng._core.inputs.grammars
    trigger = all_triggers(fmt)[which]
    lead = "" if trigger.at_start else "Hello there "

    def run() -> tuple[str, str]:
        grammars.compile(grammar)
        sampler = Sampler(SamplingParams(grammar=grammar), grammars=grammars)
        eog = np.fromiter(sorted(backend.eog_ids), dtype=np.intp)
        n_vocab = backend.info.n_vocab
        out = bytearray()
        try:
            # functionary's trigger is its marker and the first character of a tool's name (tool_0)
            written = lead + trigger.text + ("t" if fmt.recipient else "")
            want = backend.tokenize(written, add_special=False, parse_special=False)
            assert len(want) > 2  # the trigger takes several tokens in this vocabulary
            for token in want:
                logits = np.zeros(n_vocab, dtype=np.float32)
                logits[token] = 10.0
                assert sampler.sample(logits, eog) == token  # before and at the trigger: anything goes
                out += backend.token_bytes(token)
            # Now constrained: the token the logits favour ("Z") is refused for what the
            # grammar allows, and greedy picks follow the grammar to the call's start.
            forced = backend.tokenize("Z", add_special=False, parse_special=False)[-1]
            for _ in range(len(trigger.then) + 3):
                logits = np.zeros(n_vocab, dtype=np.float32)
                logits[forced] = 10.0
                token = sampler.sample(logits, eog)
                assert token != forced
                out += backend.token_bytes(token)
        finally:
            backend.retire(sampler)
        return out.decode(), trigger.text

    text, trig = await eng._core.worker.call(run)
    after = text[text.index(trig) + len(trig):]
    if fmt_name in ("cohere", "solar"):  # the model's call id comes before the tool's name
        assert re.match(re.escape(trigger.then) + r"\d", after), (fmt_name, text)
        return
    expected = trigger.then + ("" if fmt.tool_trigger else "tool_0")  # a per-tool trigger names it itself
    assert (after.startswith(expected) or expected.startswith(after)), (fmt_name, text)


def test_trigger_patterns_match_only_at_the_end_and_at_the_start_when_asked() -> None:
    """What llama.cpp searches after each token (its std::regex ECMAScript; these patterns
    use only what Python's re reads the same): the trigger, then a beginning of what the
    grammar writes after it, at the end of the text so far, from the capture group on."""
    hermes = HERMES.triggers[0].pattern
    for text, fed in [
        ("Hi <tool_call>", "<tool_call>"),
        ("<tool_call>\n{", "<tool_call>\n{"),
        ('a<tool_call>\n{"name": "', None),
    ]:
        m = re.search(hermes, text)
        assert m is not None and m.group(1) == (fed or text[1:])
    assert re.search(hermes, "<tool_call> {") is None  # not what the grammar writes: stays free
    assert re.search(hermes, "<tool_call>\n{x") is None
    generic = GENERIC.triggers[0].pattern
    assert generic.startswith("^") and generic.endswith("$")
    assert re.fullmatch(generic, ' \n{"tool_calls"').group(1) == '{"tool_calls"'  # type: ignore[union-attr]
    assert re.fullmatch(generic, 'x {"tool_calls"') is None


def test_muse_glimmers_trigger_is_a_message_to_a_declared_tool() -> None:
    """As llama.cpp's pattern, which skips ``self`` and ``user``: reasoning and the answer stay
    free; a message to ``tool_0`` starts the grammar, which writes that message from its start."""
    grammar = tools_grammar(OK_TOOL, FORMATS["muse_glimmer"])  # type: ignore[arg-type]
    (pattern,) = grammar.triggers
    for free in (" to=self<|message|>", "<|eom|><|start|>assistant to=user<|message|>", " to=tool_1<|message|>"):
        assert re.search(pattern, free) is None, free
    m = re.search(pattern, " to=self<|message|>hm<|eom|><|start|>assistant to=tool_0<|message|><atem:")
    assert m is not None and m.group(1) == " to=tool_0<|message|><atem:"
    assert '" to=tool_0<|message|><atem:function_calls>' in grammar.text


async def test_a_tool_schema_no_value_satisfies_names_its_tool(engine: Any) -> None:
    eng = engine.state.engine
    messages = [{"role": "user", "content": "call a tool"}]
    bad = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]}
    body = {"tools": tools_body([{"type": "object"}, bad]), "tool_choice": "required", "messages": messages}
    with pytest.raises(ParamError) as info:
        await eng.prepare("chat", body)
    assert info.value.param == "tools[1].function.parameters" and "no value can satisfy" in info.value.message
    # A keyword no grammar enforces is left out of a tool's grammar (Claude Code's tools use
    # propertyNames), and of a response_format without strict; refused with strict.
    loose = {"type": "object", "properties": {
        "n": {"type": "integer", "multipleOf": 3}, "m": {"type": "object", "propertyNames": {"pattern": "^a"}},
        "script": {"type": "string", "maxLength": 524288},  # Claude Code's
        "args": {"description": "any JSON value"},  # annotations alone: any value
    }}
    relaxed = {"tools": tools_body([loose]), "tool_choice": "required", "messages": messages}
    assert (await eng.prepare("chat", relaxed)).params.sampling.grammar is not None
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": loose}}
    assert (
        await eng.prepare("chat", {"response_format": fmt, "messages": messages})
    ).params.sampling.grammar is not None
    with pytest.raises(ParamError) as info:
        await eng.prepare(
            "chat",
            {"response_format": {**fmt, "json_schema": {**fmt["json_schema"], "strict": True}}, "messages": messages},
        )
    assert "propertyNames" in info.value.message
    # The named function's grammar writes only that tool's call: the unsatisfiable one aside.
    named = {**body, "tool_choice": {"type": "function", "function": {"name": "tool_0"}}}
    assert (await eng.prepare("chat", named)).params.sampling.grammar is not None
    # tool_choice "none": no grammar at all, the tools still parsed.
    none = (await eng.prepare("chat", {**body, "tool_choice": "none"})).params
    assert none.sampling.grammar is None and none.tools is not None


def test_functionarys_trigger_is_a_tools_name_never_its_content_line() -> None:
    """llama.cpp's functionary trigger is ``>>>(?!all)``: ``>>>all`` is content's recipient
    line, a tool's name a call. Searched after each token, its lookahead also passes on a
    ``>>>`` that ends the text; ours waits for the character that parts a name from ``all``."""
    fmt = FORMATS["functionary"]
    req = parse_tools(
        {
            "tools": tools_body([{"type": "object"}])
            + [
                {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                for n in ("allocate", "add", "all")
            ]
        }
    )
    assert req is not None
    triggers = tools_grammar(req, fmt).triggers

    def fed(text: str) -> str | None:  # what llama.cpp feeds its grammar once the text so far matches
        for end in range(1, len(text) + 1):  # a character a token
            for p in triggers:
                m = re.search(p, text[:end])
                if m is not None:
                    return text[m.start(1):end]
        return None

    assert fed("Sure.>>>all\nThe weather is fine.") is None
    assert fed("Sure.>>>al") is None and fed("Sure.>>>a") is None and fed("Sure.>>>") is None
    assert fed('Let me check.>>>tool_0\n{"x": 1}') == ">>>t"  # from its first character on
    assert fed(">>>allocate\n{}") == ">>>allo" and fed(">>>add\n{}") == ">>>ad"
    assert fed(">>>all\n{}") is None  # a tool named "all" cannot be told from content: never triggered
    assert re.search(triggers[0], ">>>tool_0\n") and not re.search(triggers[0], '>>>tool_0\n{"')  # a beginning only
    assert (
        tools_grammar(parse_tools({"tools": tools_body([{"type": "object"}]), "tool_choice": "required"}), fmt).triggers
        == ()
    )  # type: ignore[arg-type]
    only_all = parse_tools(
        {"tools": [{"type": "function", "function": {"name": "all", "parameters": {"type": "object"}}}]}
    )
    assert only_all is not None
    lazy = tools_grammar(only_all, fmt).triggers
    assert lazy  # still lazy (no trigger would hold the grammar from the first token)
    assert all(re.search(p, ">>>all\nHi") is None for p in lazy)


async def test_functionary_under_auto_leaves_an_all_line_free_and_holds_a_call(engine: Any) -> None:
    """The same on the tiny model's sampler, a token at a time: after ``>>>all`` the grammar
    still waits (a token it would refuse is taken), after ``>>>tool_0`` it holds."""
    eng = engine.state.engine
    backend = eng._core.backend
    fmt = FORMATS["functionary"]
    req = parse_tools(
        {"tools": tools_body([{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}])}
    )
    assert req is not None
    grammar = tools_grammar(req, fmt)
    grammars = eng._core.inputs.grammars

    def run(written: str) -> bool:
        """Whether, after ``written``, a token the call's grammar refuses is still taken."""
        grammars.compile(grammar)
        sampler = Sampler(SamplingParams(grammar=grammar), grammars=grammars)
        eog = np.fromiter(sorted(backend.eog_ids), dtype=np.intp)
        try:
            for token in backend.tokenize(written, add_special=False, parse_special=False):
                logits = np.zeros(backend.info.n_vocab, dtype=np.float32)
                logits[token] = 10.0
                assert sampler.sample(logits, eog) == token
            refused = backend.tokenize("Z", add_special=False, parse_special=False)[-1]
            logits = np.zeros(backend.info.n_vocab, dtype=np.float32)
            logits[refused] = 10.0
            return sampler.sample(logits, eog) == refused
        finally:
            backend.retire(sampler)

    assert await eng._core.worker.call(lambda: run("Sure.>>>all\nThe answer"))  # content: free
    assert await eng._core.worker.call(lambda: run("Sure.>>>all"))
    assert not await eng._core.worker.call(lambda: run("Sure.>>>tool_0\n"))  # a call: the grammar holds
