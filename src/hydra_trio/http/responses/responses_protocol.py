"""OpenAI's Responses API (``POST /v1/responses``, ``POST /v1/responses/input_tokens``) as a
codec at the edge, like http/messages/messages_protocol.py: ``input`` items and ``instructions`` become the
internal chat request, the one chat pipeline runs it, and the result is shaped back as a
response object or as its event stream (each event with its ``sequence_number``).

Nothing is stored: ``store`` is accepted and every response says ``"store": false``; a request
that needs a stored one (``previous_response_id``, ``conversation``, an ``item_reference``) is
a 400 saying to send the whole conversation in ``input`` (what Codex does with
``store: false``). Tool types this server cannot run (``web_search``, ``namespace``, ...) are
dropped with one log line. docs/http-api.md lists the rest."""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from quart import Blueprint, Response

from ...engine import REASONING_EFFORTS, GenerationResult, ReplyParser, ToolCall
from ...wire.errors import ParamError
from ..generation import (
    Piece,
    cut,
    delta_pieces,
    error_event_body,
    generate_buffered,
    receipt_fields,
    sse_body,
    start_stream,
    whole_pieces,
)
from ..models import routed_json
from ..plumbing import (
    HttpError,
    app_state,
    dialect_names,
    generation_owner,
    json_response,
    needs_no_slot,
    off_loop,
    request_session,
)

log = logging.getLogger(__name__)
bp = Blueprint("responses", __name__)

# Accepted and ignored (docs/http-api.md names each).
IGNORED = (
    "model", "store", "include", "metadata", "user", "safety_identifier", "service_tier",
    "truncation", "top_logprobs", "stream_options", "prompt_cache_retention", "max_tool_calls",
)
_STORED = "this server stores no responses: send the whole conversation in input (store: false)"


def bad(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, "invalid_request_error", param=param)


# ---- request: Responses -> the internal chat request -----------------------------------------


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or an array of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad(f"{where}.content[{j}]: {kind} is not supported (this server has no multimodal model)")
        elif kind == "refusal":
            parts.append(str(part.get("refusal") or ""))
        else:
            raise bad(f"{where}.content[{j}]: content part {kind!r} is not supported")
    return "".join(parts)


def _input(raw: Any) -> list[dict[str, Any]]:
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise bad("input must be a string or an array of items", "input")
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []  # a reasoning item goes with the assistant turn that follows it
    dropped: set[str] = set()

    def assistant() -> dict[str, Any]:
        if out and out[-1]["role"] == "assistant" and "tool_calls" not in out[-1] and not reasoning:
            return out[-1]
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        out.append(msg)
        return msg

    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"{where}.role must be user, assistant, system or developer", "input")
            text = _content_text(item.get("content"), where)
            if role == "assistant":
                msg = assistant()
                msg["content"] += text
            else:  # a developer message is the system prompt's voice to templates
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise bad(f"{where}: function_call needs name and call_id", "input")
            msg = out[-1] if out and out[-1]["role"] == "assistant" and not reasoning else assistant()
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            msg.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{where}: function_call_output needs call_id", "input")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _content_text(output or "", where)})
        elif kind == "reasoning":
            for key in ("content", "summary"):
                if item.get(key) is not None and not isinstance(item[key], list):
                    raise bad(f"{where}.{key} must be an array of text parts", "input")
            for part in (item.get("content") or item.get("summary") or []):
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    reasoning.append(part["text"])
        elif kind == "item_reference":
            raise bad(f"{where}: item_reference needs a stored response; {_STORED}", "input")
        else:
            dropped.add(str(kind))  # a call of a tool this server does not run (web_search_call, ...)
    if dropped:
        log.info("/v1/responses: dropped input items of types this server cannot run: %s", ", ".join(sorted(dropped)))
    if not out:
        raise bad("input holds no message", "input")
    return out


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad("tools must be an array", "tools")
    out, dropped = [], []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise bad(f"tools[{i}] must be an object", "tools")
        if tool.get("type") != "function":
            dropped.append(str(tool.get("type")))
            continue
        if not isinstance(tool.get("name"), str):
            raise bad(f"tools[{i}] needs a name", "tools")
        fn: dict[str, Any] = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    if dropped:
        log.info("/v1/responses: dropped tools this server cannot run: %s", ", ".join(dropped))
    return out


def _tool_choice(raw: Any) -> Any:
    if raw is None or raw in ("auto", "none", "required"):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    if isinstance(raw, dict) and raw.get("type") == "allowed_tools":
        return "required" if raw.get("mode") == "required" else "auto"
    raise bad("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")


def _format(text: Any) -> dict[str, Any] | None:
    if text is not None and not isinstance(text, dict):
        raise bad("text must be an object (format)", "text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is not None and not isinstance(fmt, dict):
        raise bad("text.format must be an object with a type: text, json_object or json_schema", "text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"], "strict": fmt.get("strict")}}
    raise bad("text.format must be text, json_object or json_schema (with schema)", "text.format")


def param_names(body: dict[str, Any]) -> Callable[[str], str]:
    """The Responses API's names of the chat request's parameters (a refusal names what the
    client sent: ``tools[i].parameters``, ``text.format``, ``max_output_tokens``)."""
    raw = body.get("tools") if isinstance(body.get("tools"), list) else []
    kept = [i for i, t in enumerate(raw) if isinstance(t, dict) and t.get("type") == "function"]
    return dialect_names(
        kept,
        ((".function", ""),),
        (
            ("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
            ("max_tokens", "max_output_tokens"), ("messages", "input"),
        ),
    )


def to_chat(body: dict[str, Any], *, count_only: bool = False) -> dict[str, Any]:
    """A Responses request as the internal chat request (400 for what cannot be mapped)."""
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise bad(f"{key}: {_STORED}", key)
    if body.get("background"):
        raise bad("background responses are not supported", "background")
    messages = _input(body.get("input"))
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    chat: dict[str, Any] = {"messages": messages}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        if (choice := _tool_choice(body.get("tool_choice"))) is not None:
            chat["tool_choice"] = choice
        if body.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    effort = (body.get("reasoning") or {}).get("effort") if isinstance(body.get("reasoning"), dict) else None
    if effort is not None:  # "none" turns the template's thinking switch off; a level goes to the template
        if effort not in REASONING_EFFORTS:
            raise bad(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}", "reasoning.effort")
        chat["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
        chat["reasoning_effort"] = effort
    for key in ("cache_salt", "lora"):  # vLLM's salt, llama-server's adapter list
        if key in body:
            chat[key] = body[key]
    fmt = _format(body.get("text"))  # checked on input_tokens too: the same body, the same 400
    if count_only:
        return chat
    if fmt is not None:
        chat["response_format"] = fmt
    if (limit := body.get("max_output_tokens")) is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise bad("max_output_tokens must be a positive integer", "max_output_tokens")
        chat["max_tokens"] = limit
    for key in ("temperature", "top_p", "top_k", "stream", "seed"):
        if body.get(key) is not None:
            chat[key] = body[key]
    return chat


# ---- reply: the result as a response object, or as its event stream --------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def item_of(piece: Piece, item_id: str) -> dict[str, Any]:
    if isinstance(piece, ToolCall):
        return {"id": item_id, "type": "function_call", "status": "completed", "call_id": piece.id, "name": piece.name, "arguments": piece.arguments}
    kind, text = piece
    if kind == "reasoning":
        return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": "completed", "content": [part]}


def _prefix(piece: Piece) -> str:
    return "fc" if isinstance(piece, ToolCall) else "rs" if piece[0] == "reasoning" else "msg"


def usage(res: GenerationResult) -> dict[str, Any]:
    return {
        "input_tokens": res.prompt_tokens,
        "input_tokens_details": {"cached_tokens": res.n_common},
        "output_tokens": res.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": res.prompt_tokens + res.completion_tokens,
    }


class Shell:
    """The response object's fields that echo the request, and its id and time."""

    def __init__(self, rid: str, model: str, body: dict[str, Any], chat: dict[str, Any]) -> None:
        self.rid, self.created = rid, int(time.time())
        text = body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}}
        self.fields = {
            "model": model,
            "instructions": body.get("instructions"),
            "tools": [t for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "function"],
            "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": None,
            "reasoning": body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {"effort": None, "summary": None},
            "store": False,
            "text": text,
            "truncation": "disabled",
            "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        }

    def response(self, status: str, output: list[dict[str, Any]], res: GenerationResult | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": None, "output": output, **self.fields, "usage": None if res is None else usage(res),
        }
        if status == "incomplete" and res is not None:
            # A cut turn (its receipt says why and what stays) is ours: "cancelled".
            reason = "cancelled" if res.stop_type == "cancelled" else "max_output_tokens"
            body["incomplete_details"] = {"reason": reason}
            body.update(receipt_fields(res))
        return body


def status_of(res: GenerationResult) -> str:
    return "incomplete" if res.stop_type in ("limit", "context", "cancelled") else "completed"


def response_body(shell: Shell, res: GenerationResult, parser: ReplyParser | None) -> dict[str, Any]:
    output = [item_of(p, _id(_prefix(p))) for p in whole_pieces(res, parser)]
    return shell.response(status_of(res), output, res)


class ResponseEvents:
    """One response's event stream: response.created and .in_progress, an output item per run
    of reasoning or text (with its content part and deltas) and per function call, then
    response.completed (or .incomplete) holding the whole response."""

    def __init__(self, shell: Shell, parser: ReplyParser | None) -> None:
        self.shell, self.parser = shell, parser
        self._seq = 0
        self._output: list[dict[str, Any]] = []
        self._open: str | None = None  # the open item's kind: "reasoning" or "text"
        self._text = ""
        start = shell.response("in_progress", [])
        self.head = self._event("response.created", response=start) + self._event("response.in_progress", response=start)

    def _event(self, kind: str, /, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        return f"event: {kind}\ndata: ".encode() + body + b"\n\n"

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        kind, self._open = self._open, None
        index = len(self._output) - 1
        item = self._output[index]
        text, self._text = self._text, ""
        loc = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            out = self._event("response.reasoning_text.done", **loc, text=text)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item.update(status="completed", content=[part])
            out = self._event("response.output_text.done", **loc, text=text, logprobs=[])
        out += self._event("response.content_part.done", **loc, part=part)
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def _pieces(self, pieces: list[Piece]) -> bytes:
        out = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                out.append(self._close())
                index = len(self._output)
                item = item_of(piece, _id("fc"))
                self._output.append(item)
                out.append(self._event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "arguments": ""}))
                loc = {"item_id": item["id"], "output_index": index}
                out.append(self._event("response.function_call_arguments.delta", **loc, delta=piece.arguments))
                out.append(self._event("response.function_call_arguments.done", **loc, name=piece.name, arguments=piece.arguments))
                out.append(self._event("response.output_item.done", output_index=index, item=item))
                continue
            kind, text = piece
            if self._open != kind:
                out.append(self._close())
                self._open = kind
                index = len(self._output)
                item = item_of((kind, ""), _id("rs" if kind == "reasoning" else "msg"))
                if kind == "reasoning":
                    item["content"] = []
                else:
                    item.update(status="in_progress", content=[])
                self._output.append(item)
                out.append(self._event("response.output_item.added", output_index=index, item=dict(item, content=[])))
                part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part))
            index = len(self._output) - 1
            loc = {"item_id": self._output[index]["id"], "output_index": index, "content_index": 0}
            self._text += text
            if kind == "reasoning":
                out.append(self._event("response.reasoning_text.delta", **loc, delta=text))
            else:
                out.append(self._event("response.output_text.delta", **loc, delta=text, logprobs=[]))
        return b"".join(out)

    def delta(self, text: str) -> bytes:
        if self.parser is None:
            return self._pieces([("text", text)] if text else [])
        return self._pieces(delta_pieces(self.parser.feed(text)))

    def done(self, res: GenerationResult) -> bytes:
        rest = b"" if self.parser is None else self._pieces(delta_pieces(self.parser.finish(cut=cut(res))))
        status = status_of(res)
        final = self.shell.response(status, self._output, res)
        return rest + self._close() + self._event(f"response.{status}", response=final)

    def error(self, exc: BaseException) -> bytes:
        err = error_event_body(exc)["error"]
        return self._event("error", code=str(err["code"]), message=err["message"], param=None)


@bp.post("/v1/responses/input_tokens")
@needs_no_slot
async def input_tokens() -> Response:
    engine, body = await routed_json()  # the engine of the model it names
    chat = await off_loop(lambda: to_chat(body, count_only=True))
    try:
        n = len(await engine.prompt_tokens(chat))
    except ParamError as exc:
        raise exc.renamed(param_names(body)) from None
    return json_response({"object": "response.input_tokens", "input_tokens": n})


@bp.post("/v1/responses")
async def responses() -> Response:
    state = app_state()
    engine, body = await routed_json()  # the engine of the model it names
    chat = await off_loop(lambda: to_chat(body))
    try:
        prepared = await engine.prepare("chat", chat)
    except ParamError as exc:
        raise exc.renamed(param_names(body)) from None
    params, tokens, replies = prepared.params, prepared.tokens, prepared.replies
    assert tokens is not None, "tokenized"
    session = request_session(body)  # its agent session (Codex: the session_id header, prompt_cache_key)
    rid = _id("resp")
    owner = generation_owner(rid)
    model = body.get("model") if isinstance(body.get("model"), str) else engine.served_name
    shell = Shell(rid, model, body, chat)
    if not params.stream:
        _slot, res = await generate_buffered(state, engine, tokens, params, owner=owner, path="responses", session=session)
        return json_response(response_body(shell, res, None if replies is None else replies()))
    stream = await start_stream(state, engine, tokens, params, owner=owner, path="responses", session=session)
    events = ResponseEvents(shell, None if replies is None else replies())
    out = sse_body(
        stream, head=events.head, delta_event=events.delta, done_event=events.done, direct=False, done=b"",
        error_event=events.error,
    )
    return Response(out, status=200, content_type="text/event-stream", headers={"Cache-Control": "no-cache"})
