"""A recording server for the compatibility corpus: an HTTP server on loopback that logs every
request (method, path, headers, JSON body) and answers in the shape of the API asked, so that a
real client goes on to its next turn.

It serves ``POST /v1/messages`` (and ``/count_tokens``), ``/v1/chat/completions`` and
``/v1/responses``, streamed or not, and ``GET .../models``. Its replies follow a ``Plan``: on a
request with tools and no tool result yet it calls one tool (the plan's preferred one, with
arguments made from the tool's own schema unless the plan gives them); after that it calls the
plan's "final" tool if the request has one (an agent framework's output tool), else answers a
document of the requested schema (``response_format``, ``text.format``, ``output_format``), else
plain text. Stdlib only: it runs in the recording environment (record.py), never in the tests.
"""

from __future__ import annotations

import copy
import gzip
import itertools
import json
import math
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# Headers kept in a capture: what says which client and protocol version sent it. Anything
# that can carry a credential or a per-machine id is left out.
KEPT_HEADERS = (
    "content-type",
    "user-agent",
    "anthropic-version",
    "anthropic-beta",
    "anthropic-dangerous-direct-browser-access",
    "openai-beta",
    "originator",
    "version",
    "x-app",
    "x-stainless-lang",
    "x-stainless-package-version",
    "x-stainless-runtime",
    "x-stainless-runtime-version",
    "x-stainless-helper-method",
    "x-stainless-helper",
    "accept",
    "content-encoding",
)


@dataclass
class Plan:
    """How the recorder answers one scenario's requests."""

    prefer: list[str] = field(default_factory=list)  # the first of these the request has is called
    args: dict[str, Any] = field(default_factory=dict)  # tool name -> arguments (else from its schema)
    final_tools: list[str] = field(default_factory=list)  # called once a tool result is back
    tool_turns: int = 1  # tool results after which the reply is text (or the final tool)
    text: str = "Done."
    once: list[str] = field(default_factory=list)  # called at most once a scenario (a subagent's
    # request has the Agent tool too: calling it again would nest agents to the client's limit)
    called: set[str] = field(default_factory=set)


@dataclass
class Captured:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    scenario: str
    reply: str  # what the recorder answered: "text", "json", "call:NAME", "error"


# -- the request's shape, per dialect ------------------------------------------------------------


def dialect(path: str) -> str:
    if path.endswith("/messages/count_tokens"):
        return "messages.count_tokens"
    if path.endswith("/messages"):
        return "messages"
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/responses"):
        return "responses"
    return "other"


def tools_of(body: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of the request's function tools."""
    out: dict[str, dict[str, Any]] = {}
    for tool in body.get("tools") or []:
        if kind == "chat" and tool.get("type") == "function":
            fn = tool["function"]
            out[fn["name"]] = fn.get("parameters") or {"type": "object"}
        elif kind == "responses" and tool.get("type") == "function":
            out[tool["name"]] = tool.get("parameters") or {"type": "object"}
        elif kind == "messages" and "input_schema" in tool:
            out[tool["name"]] = tool["input_schema"]
    return out


def tool_results(body: dict[str, Any], kind: str) -> int:
    if kind == "chat":
        return sum(1 for m in body.get("messages") or [] if m.get("role") == "tool")
    if kind == "responses":
        items = body.get("input")
        return (
            sum(1 for i in items if isinstance(i, dict) and i.get("type") == "function_call_output")
            if isinstance(items, list)
            else 0
        )
    if kind == "messages":
        n = 0
        for m in body.get("messages") or []:
            if m.get("role") == "user" and isinstance(m.get("content"), list):
                n += sum(1 for b in m["content"] if b.get("type") == "tool_result")
        return n
    return 0


def format_schema(body: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The schema of the typed answer the request asks for (``{}``: any JSON object)."""
    fmt: Any = None
    if kind == "chat":
        fmt = body.get("response_format")
    elif kind == "responses":
        fmt = (body.get("text") or {}).get("format")
    elif kind == "messages":
        fmt = body.get("output_format") or (body.get("output_config") or {}).get("format")
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_schema":
        inner = fmt.get("json_schema", fmt)  # chat nests it; Responses and Messages do not
        return inner.get("schema") or {}
    if fmt.get("type") == "json_object":
        return {}
    return None


# -- a value of a schema: the smallest plausible one -------------------------------------------

_STRING_GUESSES = ("x", "a", "A", "1", "abc", "a1", "123456", "x@example.com", "2025-01-01", "Paris", "ab-12", "AB12")
_FORMATS = {
    "date-time": "2025-01-01T00:00:00Z",
    "date": "2025-01-01",
    "time": "00:00:00Z",
    "uri": "https://example.com/",
    "url": "https://example.com/",
    "uri-reference": "https://example.com/",
    "email": "a@example.com",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "hostname": "example.com",
    "duration": "P1D",
}


def example_value(schema: Any, root: Any | None = None, depth: int = 0) -> Any:
    """A value valid for ``schema`` in the common cases (enough for the clients' own checks)."""
    root = schema if root is None else root
    if not isinstance(schema, dict) or depth > 30:
        return {}
    if "$ref" in schema:
        ref = schema["$ref"]
        target: Any = root
        if ref != "#":
            for part in ref.lstrip("#/").split("/"):
                target = target.get(part.replace("~1", "/").replace("~0", "~"), {})
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        return example_value({**target, **rest} if rest and isinstance(target, dict) else target, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            options = schema[key]
            non_null = [o for o in options if not (isinstance(o, dict) and o.get("type") == "null")]
            # A nullable field: null is valid and the smallest answer.
            if len(non_null) < len(options) and not schema.get("default"):
                return None
            return example_value(options[0], root, depth + 1)
    if schema.get("allOf"):
        merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            if isinstance(part, dict):
                for k, v in part.items():
                    if k == "properties":
                        merged.setdefault("properties", {}).update(v)
                    elif k == "required":
                        merged["required"] = [*merged.get("required", []), *v]
                    else:
                        merged.setdefault(k, v)
        return example_value(merged, root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((t for t in kind if t != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    if kind == "object":
        props = schema.get("properties") or {}
        return {name: example_value(props.get(name, {}), root, depth + 1) for name in schema.get("required") or []}
    if kind == "array":
        prefix = [example_value(s, root, depth + 1) for s in schema.get("prefixItems") or []]
        n = max(schema.get("minItems") or 0, len(prefix))
        item = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        return (prefix + [example_value(item, root, depth + 1) for _ in range(n - len(prefix))])[:n] if n else []
    if kind == "string":
        return _example_string(schema)
    if kind in ("integer", "number"):
        return _example_number(schema, kind == "integer")
    if kind == "boolean":
        return False
    return None


def _example_number(schema: dict[str, Any], integer: bool) -> int | float:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    lo_x, hi_x = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if isinstance(lo_x, (int, float)) and not isinstance(lo_x, bool):
        lo = lo_x + 1 if integer or (hi_x is None and hi is None) else lo_x
    if isinstance(hi_x, (int, float)) and not isinstance(hi_x, bool):
        hi = hi_x - 1 if integer or lo is None else hi_x
    if lo is not None and hi is not None and not integer:
        return (lo + hi) / 2  # strictly inside when a bound is exclusive
    value = lo if lo is not None else min(1, hi) if hi is not None else 1
    return math.ceil(value) if integer else value


def _example_string(schema: dict[str, Any]) -> str:
    if schema.get("format") in _FORMATS:
        return _FORMATS[schema["format"]]
    n = max(schema.get("minLength") or 1, 1)
    pattern = schema.get("pattern")
    if pattern:
        for guess in (*_STRING_GUESSES, "x" * n):
            try:
                if re.search(pattern, guess):
                    return guess
            except re.error:
                break
    return "x" * n


# -- replies -----------------------------------------------------------------------------------

_ids = itertools.count(1)


def _id(prefix: str) -> str:
    return f"{prefix}_rec{next(_ids):04d}"


def _restart_ids() -> None:
    """Ids count from 1 in each scenario: recording one client alone gives the bytes a full run does."""
    global _ids
    _ids = itertools.count(1)


def _sse(events: list[tuple[str | None, Any]]) -> bytes:
    out = []
    for name, data in events:
        line = data if isinstance(data, str) else json.dumps(data)
        out.append((f"event: {name}\n" if name else "") + f"data: {line}\n\n")
    return "".join(out).encode()


def decide(body: dict[str, Any], kind: str, plan: Plan) -> tuple[str, Any]:
    """("call", (name, arguments)) or ("text", text) for this request."""
    tools = tools_of(body, kind)
    done = tool_results(body, kind)
    choice = body.get("tool_choice")
    if tools and choice not in ("none", {"type": "none"}):
        named = _named_choice(choice)
        if named in tools:
            return "call", (named, _args(named, tools, plan))
        if done < plan.tool_turns:
            name = next((n for n in plan.prefer if n in tools and not (n in plan.once and n in plan.called)), None)
            if name is None and not plan.prefer:
                name = next(iter(tools))
            if name is not None:
                plan.called.add(name)
                return "call", (name, _args(name, tools, plan))
        final = next((n for n in plan.final_tools if n in tools), None)
        if final is not None:
            return "call", (final, _args(final, tools, plan))
        if choice in ("required", "any", {"type": "any"}) and not plan.final_tools:
            name = next(iter(tools))
            return "call", (name, _args(name, tools, plan))
    schema = format_schema(body, kind)
    if schema is not None:
        value = plan.args.get("$format", example_value(schema))
        return "text", json.dumps(value)
    return "text", plan.text


def _named_choice(choice: Any) -> str | None:
    if isinstance(choice, dict):
        if choice.get("type") == "tool":  # Anthropic
            return choice.get("name")
        if choice.get("type") == "function":
            return choice.get("name") or (choice.get("function") or {}).get("name")
    return None


def _args(name: str, tools: dict[str, dict[str, Any]], plan: Plan) -> dict[str, Any]:
    return copy.deepcopy(plan.args[name]) if name in plan.args else example_value(tools[name])


def reply(kind: str, body: dict[str, Any], plan: Plan) -> tuple[bytes, str, str]:
    """(body bytes, content type, what was answered)."""
    if kind == "messages.count_tokens":
        return json.dumps({"input_tokens": len(json.dumps(body)) // 4}).encode(), "application/json", "count"
    action, what = decide(body, kind, plan)
    model = body.get("model") or "recorded"
    stream = bool(body.get("stream"))
    label = f"call:{what[0]}" if action == "call" else "text"
    if kind == "messages":
        return _messages(model, action, what, stream), "text/event-stream" if stream else "application/json", label
    if kind == "chat":
        return _chat(model, action, what, stream, body), "text/event-stream" if stream else "application/json", label
    if kind == "responses":
        return (
            _responses(model, action, what, stream, body),
            "text/event-stream" if stream else "application/json",
            label,
        )
    raise KeyError(kind)


def _messages(model: str, action: str, what: Any, stream: bool) -> bytes:
    usage = {"input_tokens": 10, "output_tokens": 5, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    if action == "call":
        block: dict[str, Any] = {"type": "tool_use", "id": _id("toolu"), "name": what[0], "input": what[1]}
        stop = "tool_use"
    else:
        block = {"type": "text", "text": what}
        stop = "end_turn"
    msg = {"id": _id("msg"), "type": "message", "role": "assistant", "model": model, "content": [block],
           "stop_reason": stop, "stop_sequence": None, "usage": usage}
    if not stream:
        return json.dumps(msg).encode()
    start = {**msg, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    if action == "call":
        first = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(what[1])}
    else:
        first = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": what}
    return _sse([
        ("message_start", {"type": "message_start", "message": start}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": first}),
        ("ping", {"type": "ping"}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                           "usage": {"output_tokens": 5}}),
        ("message_stop", {"type": "message_stop"}),
    ])


def _chat(model: str, action: str, what: Any, stream: bool, body: dict[str, Any]) -> bytes:
    cid, created = _id("chatcmpl"), int(time.time())
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    if action == "call":
        call = {"id": _id("call"), "type": "function", "function": {"name": what[0], "arguments": json.dumps(what[1])}}
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        finish = "tool_calls"
    else:
        message = {"role": "assistant", "content": what}
        finish = "stop"
    if not stream:
        return json.dumps({"id": cid, "object": "chat.completion", "created": created, "model": model,
                           "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                           "usage": usage}).encode()

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}

    events: list[tuple[str | None, Any]] = [(None, chunk({"role": "assistant", "content": ""}))]
    if action == "call":
        events.append((None, chunk({"tool_calls": [{"index": 0, **call}]})))
    else:
        events.append((None, chunk({"content": what})))
    events.append((None, chunk({}, finish)))
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append((None, {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                              "choices": [], "usage": usage}))
    events.append((None, "[DONE]"))
    return _sse(events)


def _responses(model: str, action: str, what: Any, stream: bool, body: dict[str, Any]) -> bytes:
    rid, created = _id("resp"), int(time.time())
    if action == "call":
        item: dict[str, Any] = {"type": "function_call", "id": _id("fc"), "call_id": _id("call"), "name": what[0],
                                "arguments": json.dumps(what[1]), "status": "completed"}
    else:
        item = {"type": "message", "id": _id("msg"), "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": what, "annotations": [], "logprobs": []}]}
    response = {
        "id": rid, "object": "response", "created_at": created, "status": "completed", "model": model,
        "output": [item], "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "text": body.get("text") or {"format": {"type": "text"}}, "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), "metadata": {}, "temperature": 1.0, "top_p": 1.0,
        "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None}, "store": False, "truncation": "disabled",
        "usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
                  "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15},
    }
    if not stream:
        return json.dumps(response).encode()
    seq = itertools.count()

    def ev(name: str, **data: Any) -> tuple[str, Any]:
        return name, {"type": name, "sequence_number": next(seq), **data}

    pending = {**response, "status": "in_progress", "output": [], "usage": None}
    events = [ev("response.created", response=pending), ev("response.in_progress", response=pending)]
    if action == "call":
        events += [
            ev("response.output_item.added", output_index=0, item={**item, "arguments": "", "status": "in_progress"}),
            ev("response.function_call_arguments.delta", output_index=0, item_id=item["id"], delta=item["arguments"]),
            ev(
                "response.function_call_arguments.done", output_index=0, item_id=item["id"], arguments=item["arguments"]
            ),
        ]
    else:
        part = item["content"][0]
        events += [
            ev("response.output_item.added", output_index=0, item={**item, "content": [], "status": "in_progress"}),
            ev("response.content_part.added", output_index=0, item_id=item["id"], content_index=0,
               part={**part, "text": ""}),
            ev("response.output_text.delta", output_index=0, item_id=item["id"], content_index=0, delta=what,
               logprobs=[]),
            ev("response.output_text.done", output_index=0, item_id=item["id"], content_index=0, text=what,
               logprobs=[]),
            ev("response.content_part.done", output_index=0, item_id=item["id"], content_index=0, part=part),
        ]
    events += [ev("response.output_item.done", output_index=0, item=item), ev("response.completed", response=response)]
    return _sse(events)


_MODELS = {
    "object": "list",
    "data": [{"id": "recorded", "object": "model", "type": "model", "created": 0, "owned_by": "recorder",
              "display_name": "recorded", "created_at": "2025-01-01T00:00:00Z"}],
    "has_more": False, "first_id": "recorded", "last_id": "recorded",
    "models": [],  # Codex's own /models shape (a list of model infos): empty, it keeps its defaults
}


# -- the server --------------------------------------------------------------------------------


class Recorder:
    """``with Recorder() as rec:`` -> a server on ``rec.url``; ``rec.scenario(name, plan)`` tags
    the requests that follow; ``rec.captured`` holds them in order."""

    def __init__(self) -> None:
        self.captured: list[Captured] = []
        self.plan = Plan()
        self.name = "unnamed"
        self._lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet: the driver reports
                pass

            def _read(self) -> Any:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                enc = (self.headers.get("content-encoding") or "").lower()
                if enc == "gzip":
                    raw = gzip.decompress(raw)
                elif enc == "zstd":
                    try:
                        from compression import zstd  # type: ignore[import-not-found]  # 3.14+

                        raw = zstd.decompress(raw)
                    except ImportError:
                        import zstandard  # type: ignore[import-not-found]

                        raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=1 << 28)
                if not raw:
                    return None
                try:
                    return json.loads(raw)
                except ValueError:
                    return {"$raw": raw.decode("utf-8", "replace")}

            def _answer(self, status: int, data: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.send_header("request-id", _id("req"))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self) -> None:
                body = self._read() if self.command in ("POST", "PUT") else None
                path = self.path.split("?", 1)[0]
                if path == "/__scenario":  # a client script in another process names its scenario
                    with recorder._lock:
                        recorder.name = (body or {}).get("$raw", "unnamed").strip()
                        _restart_ids()
                    self._answer(200, b"{}", "application/json")
                    return
                kind = dialect(path)
                headers = {k.lower(): v for k, v in self.headers.items() if k.lower() in KEPT_HEADERS}
                # Under the lock: a client's concurrent requests (a subagent's) share the plan.
                with recorder._lock:
                    try:
                        if self.command == "GET" and path.rstrip("/").endswith("/models"):
                            data, ctype, label = json.dumps(_MODELS).encode(), "application/json", "models"
                            status = 200
                        elif self.command == "POST" and kind != "other" and isinstance(body, dict):
                            data, ctype, label = reply(kind, body, recorder.plan)
                            status = 200
                        else:
                            data, ctype, label = (
                                b'{"error": {"type": "not_found", "message": "not recorded"}}',
                                "application/json",
                                "404",
                            )
                            status = 404
                    except Exception as exc:  # a reply the recorder could not make: say so, keep the capture
                        data = json.dumps(
                            {"type": "error", "error": {"type": "api_error", "message": repr(exc)}}
                        ).encode()
                        ctype, label, status = "application/json", f"error:{exc!r}", 500
                    recorder.captured.append(Captured(self.command, self.path, headers, body, recorder.name, label))
                self._answer(status, data, ctype)

            do_GET = do_POST = do_PUT = do_DELETE = _handle

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client closing its connection early: nothing to record

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def scenario(self, name: str, plan: Plan | None = None) -> None:
        with self._lock:
            self.name, self.plan = name, plan or Plan()
            _restart_ids()

    def take(self) -> list[Captured]:
        with self._lock:
            out, self.captured = self.captured, []
        return out

    def __enter__(self) -> Recorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
