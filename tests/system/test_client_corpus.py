"""The compatibility corpus replayed (issue 49, item 6): every request that today's agent clients,
SDKs and frameworks were recorded sending (tests/corpus/README.md), sent to a live engine, and
the same requests with their tool choice forced.

Cases, each its own test:
- ``as-sent``: each captured request as the client sent it (``tool_choice``, ``stream`` and the
  typed answer as captured; streams read to their end);
- ``required``: each distinct tool list once, with ``tool_choice`` ``required`` (``any`` on
  ``/v1/messages``), on the first request that sent it;
- ``tool=NAME``: each distinct tool (name and schema) once, forced by name;
- ``typed``: each distinct pair of tools and typed answer (``response_format``, ``text.format``,
  ``output_format``), forced ``required`` and by the first tool's name;
- ``schema``: each schema pydantic and zod write (tests/corpus/schemas), as ``response_format``
  on chat and as a forced tool's ``input_schema`` on messages.

What is asserted: the engine answers 200; a stream ends as its API ends one; every call names a
declared tool and its arguments validate against that tool's schema (``jsonschema``, formats
included where jsonschema checks them); a forced request ends in at least one call (exactly the
named tool; at most one with ``parallel_tool_calls: false``) unless the length cap cut it; a
typed answer that ended validates against its schema; no text holds raw call syntax.

What the replay changes, and why: the synthetic model never stops, so the output cap is small
(``CAP``, ``FORCED_CAP``) and decoding greedy; the conversation's texts (system prompt, messages,
tool results) are cut to ``TEXT_CHARS`` characters, since Claude Code's ~40k-token prompt
takes minutes to prefill on a CPU (124 s for its first turn on the 2-core test VM); and the engine's template names the
tools without printing their schemas (``NAMES_TEMPLATE``, Hermes' ``<tool_call>`` syntax), for the same reason. Tools,
schemas and typed answers go to the engine byte for byte as captured.

Every case passes: when recorded, 159 were refused or leaked call syntax (issue 49: allOf on a
string, format with lengths, recursive models, z.record, z.tuple, tools beside a typed answer,
Claude Code's tool_reference results, forced calls cut by the cap); none is marked now.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from hydra_trio.testing.process import EngineProcess
from hydra_trio.testing.sse_reader import sse_data

pytestmark = pytest.mark.slow

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
CAP = 32  # output tokens of a request that forces nothing
FORCED_CAP = 160  # a forced call or a typed answer: room for one of enums and integers (~1 token a character here)
TEXT_CHARS = 200

# Hermes' syntax, with the tools named but not printed (their schemas still reach the grammar).
NAMES_TEMPLATE = """{%- if tools %}<|im_start|>system
Tools: {% for tool in tools %}{{ tool.function.name }} {% endfor %}
For each call, reply with <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or message.role == 'system' %}<|im_start|>{{ message.role }}
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

# Call syntax that must never reach a client as text: Hermes' tags, the generic JSON family's key.
LEAK = re.compile(r'<tool_call>|</tool_call>|"tool_calls"\s*:|\{\s*"name"\s*:\s*"[^"]*"\s*,\s*"arguments"')
CUT = {"length", "max_tokens", "max_output_tokens"}


# -- the corpus ------------------------------------------------------------------------------------


def resolve(value: Any) -> Any:
    """``value`` with each ``{"$corpus_ref": key}`` replaced by ``shared/<key>.json``."""
    if isinstance(value, dict):
        if set(value) == {"$corpus_ref"}:
            return resolve(json.loads((CORPUS / "shared" / f"{value['$corpus_ref']}.json").read_text()))
        return {k: resolve(v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v) for v in value]
    return value


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def function_tools(body: dict[str, Any], dialect: str) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of the request's function tools (others are not callable here)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in body.get("tools") or []:
        if dialect == "chat" and tool.get("type") == "function":
            out[tool["function"]["name"]] = tool["function"].get("parameters") or {"type": "object"}
        elif dialect == "responses" and tool.get("type") == "function":
            out[tool["name"]] = tool.get("parameters") or {"type": "object"}
        elif dialect == "messages" and "input_schema" in tool and tool.get("type", "custom") == "custom":
            out[tool["name"]] = tool["input_schema"]
    return out


def typed_schema(body: dict[str, Any], dialect: str) -> dict[str, Any] | None:
    """The schema of the typed answer asked for ({} for any JSON object), or None."""
    fmt: Any = {"chat": body.get("response_format"), "responses": (body.get("text") or {}).get("format"),
                "messages": body.get("output_format") or (body.get("output_config") or {}).get("format")}.get(dialect)
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_schema", "json_object"):
        return None
    return (fmt.get("json_schema", fmt).get("schema") or {}) if fmt["type"] == "json_schema" else {}


def forced_of(choice: Any) -> str | None:
    """"any" (a call of any tool), a tool's name, or None (the model chooses)."""
    if choice in ("required", "any") or (isinstance(choice, dict) and choice.get("type") == "any"):
        return "any"
    if isinstance(choice, dict):
        if choice.get("type") == "tool":
            return choice.get("name")
        if choice.get("type") == "function":
            return choice.get("name") or (choice.get("function") or {}).get("name")
    return None


def untyped(body: dict[str, Any]) -> dict[str, Any]:
    """The request without its typed answer: the forced variants test the tools alone (the
    ``typed-*`` cases test them beside it)."""
    body = {k: v for k, v in body.items() if k not in ("response_format", "output_format")}
    for key in ("text", "output_config"):
        if isinstance(body.get(key), dict) and "format" in body[key]:
            body[key] = {k: v for k, v in body[key].items() if k != "format"}
    return body


def choice_for(dialect: str, forced: str) -> Any:
    if dialect == "messages":
        return {"type": "any"} if forced == "any" else {"type": "tool", "name": forced}
    if dialect == "chat":
        return "required" if forced == "any" else {"type": "function", "function": {"name": forced}}
    return "required" if forced == "any" else {"type": "function", "name": forced}


_TEXT_KEYS = {"text", "content", "output", "system", "instructions", "input", "thinking"}


def shorten(value: Any, key: str | None = None) -> Any:
    """The conversation's texts cut to TEXT_CHARS; everything else (ids, call arguments, tool
    inputs, structure) as captured."""
    if isinstance(value, str):
        return value[:TEXT_CHARS] if key in _TEXT_KEYS else value
    if isinstance(value, list):
        return [shorten(v, key) for v in value]
    if isinstance(value, dict):
        return {k: shorten(v, k) for k, v in value.items()}
    return value


def prepared(body: dict[str, Any], dialect: str, cap: int) -> dict[str, Any]:
    body = copy.deepcopy(body)
    for key in ("system", "messages", "input", "instructions"):
        if key in body:
            body[key] = shorten(body[key], key)
    if dialect == "messages.count_tokens":
        return body
    if dialect == "responses":
        body["max_output_tokens"] = cap
    elif dialect == "chat" and "max_completion_tokens" in body:
        body["max_completion_tokens"] = cap
    else:
        body["max_tokens"] = cap
    body["temperature"] = 0  # greedy: the same reply on every machine
    return body


@dataclass(frozen=True, repr=False)
class Case:
    id: str
    dialect: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    tools: dict[str, dict[str, Any]]
    forced: str | None
    single: bool  # parallel_tool_calls false / disable_parallel_tool_use
    typed: dict[str, Any] | None

    def __repr__(self) -> str:  # a failure report names the case, not its 40 KB body
        return f"Case({self.id})"


def _case(
    case_id: str, dialect: str, path: str, headers: dict[str, str], body: dict[str, Any], choice: Any = None
) -> Case:
    tools = function_tools(body, dialect)
    if choice is not None:
        body = {**body, "tool_choice": choice}
    forced = forced_of(body.get("tool_choice")) if tools else None
    typed = typed_schema(body, dialect)
    cap = CAP if forced is None and typed is None else FORCED_CAP
    now = body.get("tool_choice")
    single = body.get("parallel_tool_calls") is False or (
        isinstance(now, dict) and bool(now.get("disable_parallel_tool_use"))
    )
    kept = {k: v for k, v in headers.items() if k.startswith("anthropic-") or k == "content-type"}
    return Case(case_id, dialect, path, kept, prepared(body, dialect, cap), tools, forced, single, typed)


def load_cases() -> list[Case]:
    captured: list[tuple[str, dict[str, Any]]] = []
    for path in sorted((CORPUS / "captures").rglob("*.json")):
        doc = json.loads(path.read_text())
        for r in doc["requests"]:
            if r["method"] == "POST" and r["dialect"] in ("chat", "responses", "messages", "messages.count_tokens"):
                captured.append((f"{doc['client']}/{doc['scenario']}#{r['turn']}", {**r, "body": resolve(r["body"])}))
    cases = [_case(f"as-sent:{cid}", r["dialect"], r["path"], r["headers"], r["body"]) for cid, r in captured]
    lists: set[str] = set()
    named: set[tuple[str, str]] = set()
    typed: set[str] = set()
    for cid, r in captured:
        dialect, body = r["dialect"], r["body"]
        tools = function_tools(body, dialect) if dialect != "messages.count_tokens" else {}
        if not tools:
            continue
        key = digest([dialect, sorted(tools), [tools[n] for n in sorted(tools)]])
        if key not in lists:
            lists.add(key)
            cases.append(
                _case(f"required:{cid}", dialect, r["path"], r["headers"], untyped(body), choice_for(dialect, "any"))
            )
        for name, schema in tools.items():
            if (name, digest(schema)) not in named:
                named.add((name, digest(schema)))
                cases.append(
                    _case(
                        f"tool={name}:{cid}", dialect, r["path"], r["headers"], untyped(body), choice_for(dialect, name)
                    )
                )
        answer = typed_schema(body, dialect)
        if answer is not None and digest([key, answer]) not in typed:
            typed.add(digest([key, answer]))
            first = next(iter(tools))
            for forced in ("any", first):
                label = "required" if forced == "any" else f"tool={first}"
                cases.append(
                    _case(f"typed-{label}:{cid}", dialect, r["path"], r["headers"], body, choice_for(dialect, forced))
                )
    cases += schema_cases()
    return cases


def schema_cases() -> list[Case]:
    """Each distinct schema a library writes: a typed answer on chat (strict when the library
    made it strict for OpenAI), and a forced tool's input_schema on messages."""
    seen: set[str] = set()
    out: list[Case] = []
    user = [{"role": "user", "content": "Fill it in."}]
    for path in sorted((CORPUS / "schemas").glob("*.json")):
        doc = json.loads(path.read_text())
        for name, schema in doc["schemas"].items():
            if digest(schema) in seen:
                continue
            seen.add(digest(schema))
            cid = f"{doc['source']}/{name}"
            strict = name.startswith(
                ("to_strict_json_schema", "pydantic_function_tool", "zod-to-json-schema/openAi")
            ) or (doc["source"] == "zod" and name.startswith("toJSONSchema/") and name != "toJSONSchema/Open")
            fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}
            out.append(_case(f"schema-format:{cid}", "chat", "/v1/chat/completions", {},
                             {"model": "any", "messages": user, "response_format": fmt}))
            tool = {"name": "fill", "description": "Fill in the form", "input_schema": schema}
            out.append(
                _case(
                    f"schema-tool:{cid}",
                    "messages",
                    "/v1/messages",
                    {"anthropic-version": "2023-06-01"},
                    {
                        "model": "any",
                        "messages": user,
                        "tools": [tool],
                        "tool_choice": {"type": "tool", "name": "fill"},
                    },
                )
            )
    return out


# -- the replies -------------------------------------------------------------------------------------


@dataclass
class Reply:
    texts: list[str]
    calls: list[tuple[str, str]]  # (name, arguments as JSON text)
    finish: str | None
    problems: list[str]  # how the stream or the shape was wrong


def sse_events(lines: list[str]) -> tuple[list[tuple[str | None, str]], list[str]]:
    """(event name, data) pairs of an SSE body; what is not SSE goes to the problems."""
    events: list[tuple[str | None, str]] = []
    problems: list[str] = []
    name = None
    for line in lines:
        if not line:
            name = None
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif (data := sse_data(line)) is not None:
            events.append((name, data))
        elif not line.startswith(":"):
            problems.append(f"not an SSE line: {line[:80]!r}")
    return events, problems


def read_chat(body: dict[str, Any] | None, lines: list[str] | None) -> Reply:
    if lines is None:
        assert body is not None
        choice = body["choices"][0]
        msg = choice["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
        return Reply([msg.get("content") or ""], calls, choice.get("finish_reason"), [])
    events, problems = sse_events(lines)
    if not events or events[-1][1] != "[DONE]":
        problems.append("the stream did not end with [DONE]")
    text, parts, finish = "", {}, None
    for _, data in events:
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            problems.append(f"error event: {chunk['error']}")
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                part = parts.setdefault(call["index"], ["", ""])
                part[0] += (call.get("function") or {}).get("name") or ""
                part[1] += (call.get("function") or {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    if finish is None:
        problems.append("no finish_reason in the stream")
    return Reply([text], [tuple(parts[i]) for i in sorted(parts)], finish, problems)  # type: ignore[misc]


def read_messages(body: dict[str, Any] | None, lines: list[str] | None) -> Reply:
    problems: list[str] = []
    if lines is not None:
        events, problems = sse_events(lines)
        names = [n for n, _ in events]
        if not names or names[-1] != "message_stop":
            problems.append(f"the stream did not end with message_stop (last: {names[-1:]})")
        blocks: dict[int, dict[str, Any]] = {}
        stop = None
        for name, data in events:
            ev = json.loads(data)
            if name == "error" or ev.get("type") == "error":
                problems.append(f"error event: {ev.get('error')}")
            elif ev["type"] == "content_block_start":
                blocks[ev["index"]] = {**ev["content_block"], "_json": ""}
            elif ev["type"] == "content_block_delta":
                delta, block = ev["delta"], blocks[ev["index"]]
                if delta["type"] == "text_delta":
                    block["text"] = block.get("text", "") + delta["text"]
                elif delta["type"] == "input_json_delta":
                    block["_json"] += delta["partial_json"]
            elif ev["type"] == "message_delta":
                stop = ev["delta"].get("stop_reason")
        content = []
        for i in sorted(blocks):
            block = blocks[i]
            if block["type"] == "tool_use":
                block["input"] = block["_json"] or json.dumps(block.get("input") or {})
            content.append(block)
        body = {"content": content, "stop_reason": stop}
    assert body is not None
    texts = [b.get("text", "") for b in body["content"] if b["type"] == "text"]
    calls = [(b["name"], b["input"] if isinstance(b["input"], str) else json.dumps(b["input"]))
             for b in body["content"] if b["type"] == "tool_use"]
    return Reply(texts, calls, body.get("stop_reason"), problems)


def read_responses(body: dict[str, Any] | None, lines: list[str] | None) -> Reply:
    problems: list[str] = []
    if lines is not None:
        events, problems = sse_events(lines)
        last = json.loads(events[-1][1]) if events else {}
        if last.get("type") not in ("response.completed", "response.incomplete"):
            problems.append(f"the stream did not end with response.completed or .incomplete (last: {last.get('type')})")
            return Reply([], [], None, problems)
        body = last["response"]
    assert body is not None
    texts = [p.get("text", "") for item in body["output"] if item["type"] == "message" for p in item["content"]]
    calls = [(item["name"], item["arguments"]) for item in body["output"] if item["type"] == "function_call"]
    finish = (body.get("incomplete_details") or {}).get("reason") if body["status"] == "incomplete" else body["status"]
    return Reply(texts, calls, finish, problems)


READERS = {"chat": read_chat, "messages": read_messages, "responses": read_responses}


@dataclass
class Raw:
    """What the engine answered a case: its status, and its JSON body or its stream's lines."""

    status: int
    body: Any = None
    lines: list[str] | None = None
    error: str = ""


def fetch(client: httpx.Client, case: Case) -> Raw:
    if case.body.get("stream"):
        with client.stream("POST", case.path, json=case.body, headers=case.headers) as r:
            if r.status_code != 200:
                r.read()
                return Raw(r.status_code, error=error_of(r))
            return Raw(200, lines=list(r.iter_lines()))
    r = client.post(case.path, json=case.body, headers=case.headers)
    return (
        Raw(r.status_code, body=r.json(), error=error_of(r))
        if r.status_code == 200
        else Raw(r.status_code, error=error_of(r))
    )


def read(case: Case, raw: Raw) -> Reply:
    if raw.status != 200:
        pytest.fail(f"HTTP {raw.status}: {raw.error}")
    if case.dialect == "messages.count_tokens":
        assert isinstance(raw.body["input_tokens"], int) and raw.body["input_tokens"] > 0, raw.body
        return Reply([], [], "counted", [])
    return READERS[case.dialect](raw.body, raw.lines)


def error_of(r: httpx.Response) -> str:
    if r.status_code == 200:
        return ""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:300]


def validate(value: Any, schema: dict[str, Any]) -> None:
    cls = jsonschema.validators.validator_for(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)


# -- the test ----------------------------------------------------------------------------------------

CASES = load_cases()


@pytest.fixture(scope="module")
def client(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """One engine for the module (the cases are many and each is short), in its own process. One
    slot: consecutive cases of a tool list find their prompt in its prefix cache, and more slots
    made the run slower here (4 slots side by side: 33 s for what one does in 29 s)."""
    logs = tmp_path_factory.mktemp("corpus")
    template = logs / "names.jinja"
    template.write_text(NAMES_TEMPLATE)
    engine = EngineProcess(str(tiny_model), slots=1, ctx_size=8192, threads=1, batch_size=256,
                           extra=("--chat-template-file", str(template)))
    engine.start(logs, "engine")
    try:
        with httpx.Client(base_url=engine.url, timeout=300) as c:
            yield c
    finally:
        engine.stop()


def test_corpus_covers_the_clients() -> None:
    """The corpus holds what issue 49 names: a test that cannot go vacuous if files go missing."""
    index = json.loads((CORPUS / "index.json").read_text())
    clients = {e["client"] for e in index if e["kind"] == "capture" and e["requests"]}
    assert {"claude-code", "codex", "openai-python", "anthropic-python", "openai-node",
            "openai-agents", "pydantic-ai", "langchain"} <= clients
    assert {e["client"] for e in index if e["kind"] == "schemas"} >= {"pydantic", "zod"}
    cc = json.loads((CORPUS / "claude-code-tools.json").read_text())
    assert len(cc["tools"]) >= 20
    kinds = {c.id.split(":")[0] for c in CASES}
    assert {"as-sent", "required", "typed-required", "schema-format", "schema-tool"} <= kinds
    assert any(k.startswith("tool=") for k in kinds)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_replay(client: httpx.Client, case: Case) -> None:
    reply = read(case, fetch(client, case))
    assert not reply.problems, reply.problems
    if case.dialect == "messages.count_tokens":
        return
    for text in reply.texts:
        assert not LEAK.search(text), f"raw call syntax in the text: {text[:300]!r}"
    for name, arguments in reply.calls:
        assert name in case.tools, f"a call of an undeclared tool {name!r}"
        validate(json.loads(arguments), case.tools[name])
    cut = reply.finish in CUT
    if case.forced is not None and not cut:
        assert reply.calls, f"forced {case.forced!r}, ended {reply.finish!r} with no call"
    if case.forced not in (None, "any"):
        assert {n for n, _ in reply.calls} <= {case.forced}, reply.calls
    if case.single:
        assert len(reply.calls) <= 1, reply.calls
    if reply.calls and not cut and case.dialect != "responses":
        assert reply.finish in ("tool_calls", "tool_use"), reply.finish
    if case.typed is not None and not reply.calls and not cut:
        validate(json.loads("".join(reply.texts)), case.typed)
