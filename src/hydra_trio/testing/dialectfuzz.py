"""A schema-driven fuzz of the chat dialects' routes (issue 50): /v1/chat/completions,
/v1/messages, /v1/messages/count_tokens, /v1/responses, /v1/responses/input_tokens.

Each route has valid bodies that use every field its codec reads (tools and tool choices, a
conversation with earlier calls and their results, reasoning items, output schemas, sampling
keys, streaming). A case takes one of them and puts any JSON value (hypothesis: nested
containers, huge integers, odd strings, schema keywords) at one to three places in it: a
field, an item, a new key, or takes one away. The reply must be well formed in the route's
own API: a 2xx; or an error in its shape (Anthropic's ``{"type": "error", "error": {type,
message}}`` on /v1/messages*, OpenAI's ``{"error": {message, type, param, code}}`` elsewhere)
with a 4xx or the documented 503; never another 5xx. A stream must end with its own end
(``[DONE]``; ``message_stop``; ``response.completed`` or ``.incomplete``) or its error event.
(Schemas are checked by the schema policy, ``engine/structured/schema_policy.py``: a bound
past what llguidance reads is relaxed, or a 400 with strict; no 5xx is exempt.)

``python -m benchmarks.dialect_fuzz --cases 20000`` runs it against its own engine process;
tests/http/test_dialect_fuzz.py runs a bounded, derandomized number of cases in-process."""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from .sse_reader import DONE, sse_data

Path = tuple[str | int, ...]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"],
}
CALL_ARGS = json.dumps({"city": "Paris"})

BODIES: dict[str, list[dict[str, Any]]] = {
    "/v1/chat/completions": [
        {
            "model": "m", "max_tokens": 4, "temperature": 0, "stream": False, "seed": 1, "top_p": 0.9, "stop": ["\n\n"],
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello"}]},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": CALL_ARGS}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "noon"},
            ],
            "tools": [{"type": "function", "function": {"name": "get_time", "description": "d", "parameters": SCHEMA}}],
            "tool_choice": "auto", "parallel_tool_calls": True, "chat_template_kwargs": {"enable_thinking": False},
            "reasoning_effort": "low", "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True},
        },
        {
            "messages": [{"role": "user", "content": "a forecast"}], "max_tokens": 8, "stream": True, "cache_salt": "s",
            "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA, "strict": True}},
        },
    ],
    "/v1/messages": [
        {
            "model": "claude", "max_tokens": 4, "temperature": 0, "top_k": 5, "stream": False, "stop_sequences": ["x"],
            "system": [{"type": "text", "text": "be brief"}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "plan", "signature": ""},
                    {"type": "tool_use", "id": "t1", "name": "get_time", "input": {"city": "Paris"}}]},
                {"role": "user",
                 "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "noon", "is_error": False}]},
            ],
            "tools": [{"name": "get_time", "description": "d", "input_schema": SCHEMA}],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": False},
            "thinking": {"type": "enabled", "budget_tokens": 16}, "metadata": {"user_id": "u"},
        },
        {
            "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "a forecast"}], "cache_salt": "s",
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
        },
    ],
    "/v1/responses": [
        {
            "model": "m", "max_output_tokens": 4, "temperature": 0, "stream": False, "store": False,
            "instructions": "be brief",
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
                {"role": "user", "content": "hi"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "plan"}]},
                {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": CALL_ARGS},
                {"type": "function_call_output", "call_id": "c1", "output": "noon"},
            ],
            "tools": [{"type": "function", "name": "get_time", "parameters": SCHEMA}, {"type": "web_search"}],
            "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"effort": "low"},
            "text": {"format": {"type": "text"}},
        },
        {
            "input": "a forecast", "max_output_tokens": 8, "stream": True, "cache_salt": "s",
            "text": {"format": {"type": "json_schema", "name": "f", "schema": SCHEMA, "strict": True}},
        },
    ],
}
BODIES["/v1/messages/count_tokens"] = [
    {k: v for k, v in b.items() if k not in ("max_tokens", "stream")} for b in BODIES["/v1/messages"]
]
BODIES["/v1/responses/input_tokens"] = [
    {k: v for k, v in b.items() if k not in ("max_output_tokens", "stream")} for b in BODIES["/v1/responses"]
]
ROUTES = tuple(BODIES)
# Keys a case may add where the valid bodies lack them (every codec reads or refuses them).
NEW_KEYS = (
    "max_tokens",
    "max_completion_tokens",
    "n",
    "logit_bias",
    "grammar",
    "json_schema",
    "response_format",
    "previous_response_id",
    "conversation",
    "background",
    "output_format",
    "thinking",
    "chat_template_kwargs",
    "kv_transfer_params",
    "speculative",
    "min_tokens",
    "ignore_eos",
    "reasoning_budget_tokens",
    "reasoning_format",
    "prompt",
    "functions",
    "function_call",
    "x",
)
SCHEMA_KEYWORDS = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "pattern",
    "format",
    "enum",
    "const",
    "$ref",
    "anyOf",
    "allOf",
    "items",
    "properties",
    "required",
    "additionalProperties",
)


# Known cases first, every run (each was a 5xx or a broken stream before issue 50): the route,
# which valid body, where, what.
CORPUS: list[tuple[str, int, Path, Any]] = [
    ("/v1/responses", 0, ("text", "format"), "json"),
    ("/v1/responses", 0, ("text", "format"), ["x"]),
    ("/v1/responses/input_tokens", 0, ("text", "format"), "json"),
    ("/v1/responses", 0, ("input", 2, "summary"), 7),
    ("/v1/responses/input_tokens", 0, ("input", 2, "summary"), 7),
    ("/v1/responses", 1, ("input",), [{"type": "reasoning", "content": 5}, {"role": "user", "content": "x"}]),
    ("/v1/responses", 0, ("max_output_tokens",), 0),
    ("/v1/chat/completions", 0, ("max_tokens",), 0),
    ("/v1/chat/completions", 1, ("chat_template_kwargs",), {"messages": [{"role": "user", "content": "x"}]}),
    ("/v1/chat/completions", 0, ("chat_template_kwargs",), {"tools": [{"name": "never_parsed"}]}),
    ("/v1/chat/completions", 0, ("chat_template_kwargs",), {"bos_token": "x", "namespace": 1}),
    ("/v1/messages", 0, ("max_tokens",), 0),
    ("/v1/messages", 1, ("messages", 0, "content"), [{"type": "text", "text": 5}]),
    ("/v1/chat/completions", 1, ("messages", 0, "content"), "[" * 1000 + "]" * 1000),
]


def corpus() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for route, which, path, value in CORPUS:
        body = copy.deepcopy(BODIES[route][which])
        put(body, path, value)
        out.append((route, body))
    return out


def paths(value: Any, at: Path = ()) -> list[Path]:
    """Every place in a body: each key of each object, each item of each list."""
    out: list[Path] = []
    if isinstance(value, dict):
        for k, v in value.items():
            out += [(*at, k), *paths(v, (*at, k))]
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += [(*at, i), *paths(v, (*at, i))]
    return out


def put(body: Any, path: Path, value: Any, *, delete: bool = False) -> None:
    """Set (or delete) ``body`` at ``path``, in place."""
    *head, last = path
    for step in head:
        body = body[step]
    if delete:
        del body[last]
    else:
        body[last] = value


def strategies(route: str) -> Any:
    """hypothesis: bodies of ``route`` with one to three places changed."""
    from hypothesis import strategies as st

    scalars = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30, -(10**400), 10**400])
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=20)
        | st.sampled_from(
            [
                "",
                "none",
                "auto",
                "required",
                "text",
                "json",
                "json_object",
                "json_schema",
                "function",
                "tool",
                "any",
                "user",
                "assistant",
                "system",
                "developer",
                "tool_use",
                "tool_result",
                "thinking",
                "reasoning",
                "message",
                "function_call",
                "image",
                "enabled",
                "\ud800",
                "<|im_start|>",
                "{{ 7*7 }}",
                "x" * 5000,
            ]
        )
    )
    values = st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(
                st.sampled_from(["type", "text", "name", "content", "role", "schema", *SCHEMA_KEYWORDS, "x"]),
                inner,
                max_size=4,
            )
        ),
        max_leaves=8,
    )

    @st.composite
    def case(draw: Any) -> tuple[str, dict[str, Any]]:
        body = copy.deepcopy(draw(st.sampled_from(BODIES[route])))
        for _ in range(draw(st.integers(1, 3))):
            places = paths(body)
            kind = draw(st.sampled_from(["replace", "replace", "replace", "add", "delete"]))
            if kind == "add" or not places:
                put(body, (draw(st.sampled_from(NEW_KEYS)),), draw(values))
            elif kind == "delete":
                put(body, draw(st.sampled_from(places)), None, delete=True)
            else:
                put(body, draw(st.sampled_from(places)), draw(values))
        return route, body

    return case()


@dataclass
class DialectFuzzReport:
    cases: Counter[str] = field(default_factory=Counter)  # route -> cases sent
    statuses: Counter[str] = field(default_factory=Counter)  # "route status"
    findings: dict[str, list[str]] = field(default_factory=dict)  # kind -> examples
    elapsed_s: float = 0.0

    def find(self, kind: str, detail: str) -> None:
        self.findings.setdefault(kind, [])
        if len(self.findings[kind]) < 20:
            self.findings[kind].append(detail[:600])

    @property
    def n_findings(self) -> int:
        return sum(len(v) for v in self.findings.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "cases": dict(self.cases),
            "total": sum(self.cases.values()),
            "by_route_and_status": dict(sorted(self.statuses.items())),
            "findings": self.findings,
            "elapsed_s": round(self.elapsed_s, 1),
        }


def shape_problem(route: str, status: int, body: bytes) -> str | None:
    """What is wrong with an error reply of ``route``, or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return f"HTTP {status}, not JSON: {body[:200]!r}"
    if route.startswith("/v1/messages"):
        err = obj.get("error") if isinstance(obj, dict) else None
        ok = obj.get("type") == "error" and isinstance(err, dict) and set(err) == {"type", "message"}
        return None if ok else f"HTTP {status}, not Anthropic's error shape: {body[:200]!r}"
    err = obj.get("error") if isinstance(obj, dict) else None
    ok = isinstance(err, dict) and isinstance(err.get("message"), str) and err.get("code") is not None and "type" in err
    return None if ok else f"HTTP {status}, not OpenAI's error shape: {body[:200]!r}"


def stream_problem(route: str, text: str) -> str | None:
    """What is wrong with a streamed reply's end, or None."""
    if route == "/v1/chat/completions":
        data = [d for line in text.splitlines() if (d := sse_data(line)) is not None]
        if not data or data[-1] != DONE:
            return f"chat stream without [DONE]: ...{text[-200:]!r}"
        return None
    events = [line[len("event: "):] for line in text.splitlines() if line.startswith("event: ")]
    ends = (
        ("message_stop", "error") if route == "/v1/messages" else ("response.completed", "response.incomplete", "error")
    )
    if not events or events[-1] not in ends:
        return f"{route} stream ended with {events[-1:]} (want one of {ends}): ...{text[-200:]!r}"
    return None


async def exchange(client: httpx.AsyncClient, route: str, body: dict[str, Any], report: DialectFuzzReport) -> None:
    """Send one case and judge its reply."""
    report.cases[route] += 1
    data = json.dumps(body).encode()  # ASCII escapes: a lone surrogate goes out as \ud800
    async with client.stream("POST", route, content=data, headers={"content-type": "application/json"}) as r:
        raw = await r.aread()
    report.statuses[f"{route} {r.status_code}"] += 1
    case = json.dumps(body)[:300]
    if r.status_code >= 500 and r.status_code != 503:
        report.find("5xx", f"{route} HTTP {r.status_code} {raw[:200]!r} for {case}")
        return
    if r.status_code >= 400:
        if (problem := shape_problem(route, r.status_code, raw)) is not None:
            report.find("error_shape", f"{route}: {problem} for {case}")
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        if (problem := stream_problem(route, raw.decode("utf-8", "replace"))) is not None:
            report.find("stream_end", f"{problem} for {case}")
    else:
        try:
            json.loads(raw)
        except ValueError:
            report.find("not_json", f"{route} HTTP {r.status_code} {raw[:200]!r} for {case}")


async def run_fuzz(
    port: int, *, cases_per_route: int, seed: int = 0, concurrency: int = 4, time_limit_s: float = 3600.0
) -> DialectFuzzReport:
    """``cases_per_route`` cases of each route (hypothesis, seeded; the routes one after the
    other), ``concurrency`` at a time."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    report = DialectFuzzReport()
    t0 = time.monotonic()
    send, receive = trio.open_memory_channel[tuple[str, dict[str, Any]]](concurrency * 2)

    def generate() -> None:
        try:
            for case in corpus():
                trio.from_thread.run(send.send, case)
            for k, route in enumerate(ROUTES):

                @hseed(seed * 101 + k)
                @settings(max_examples=cases_per_route, database=None, deadline=None, phases=[Phase.generate],
                          suppress_health_check=list(HealthCheck))
                @given(strategies(route))
                def one(case: tuple[str, dict[str, Any]]) -> None:
                    if time.monotonic() - t0 < time_limit_s:
                        trio.from_thread.run(send.send, case)

                one()
        finally:
            trio.from_thread.run_sync(send.close)

    async def worker(client: httpx.AsyncClient) -> None:
        async for route, body in receive:
            try:
                await exchange(client, route, body, report)
            except httpx.HTTPError as exc:  # a close or reset without a reply
                report.find("transport", f"{route} {type(exc).__name__}: {exc} for {json.dumps(body)[:300]}")

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120, limits=limits) as client:
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker, client)
            await trio.to_thread.run_sync(generate)
    report.elapsed_s = time.monotonic() - t0
    return report


__all__ = ["BODIES", "ROUTES", "DialectFuzzReport", "run_fuzz", "shape_problem", "strategies", "stream_problem"]
