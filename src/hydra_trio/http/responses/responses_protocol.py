"""OpenAI's Responses API (``POST /v1/responses``, ``POST /v1/responses/input_tokens``) as a
codec at the edge, like http/messages/: ``input`` items and ``instructions`` become the
internal chat request (``to_chat``), the one chat pipeline runs it, and the result is shaped
back as a response object (``response_body``) or as its event stream, each event with its
``sequence_number`` (http/responses/responses_serving.py).

Nothing is stored: ``store`` is accepted and every response says ``"store": false``; a request
that needs a stored one (``previous_response_id``, ``conversation``, an ``item_reference``) is
a 400 saying to send the whole conversation in ``input`` (what Codex does with
``store: false``). Tool types this server cannot run (``web_search``, ``namespace``, ...) are
dropped with one log line. docs/http-api.md lists the rest."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from ...engine import REASONING_EFFORTS, GenerationResult, ReplyParser, ToolCall
from ..generation import Piece, chat_tool, dialect_names, receipt_fields, whole_pieces
from ..plumbing import HttpError

log = logging.getLogger(__name__)

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
    text = _content(content, where, images=False)
    assert isinstance(text, str)
    return text


def _content(content: Any, where: str, *, images: bool) -> str | list[dict[str, Any]]:
    """A message's content as text, or (``images``: a user's, with input_image parts) as
    OpenAI's text and ``image_url`` parts in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or an array of content parts")
    parts: list[str] = []
    ordered: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text") and isinstance(
            part.get("text"), str
        ):
            parts.append(part["text"])
            ordered.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and images:
            url = part.get("image_url")
            if not isinstance(url, str):
                raise bad(f"{where}.content[{j}]: input_image needs image_url (a data: URI or URL; file_id needs "
                          "stored files)", "input")
            ordered.append({"type": "image_url", "image_url": {"url": url}})
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad(f"{where}.content[{j}]: {kind} is not supported (this server has no multimodal model)")
        elif kind == "refusal":
            parts.append(str(part.get("refusal") or ""))
        else:
            raise bad(f"{where}.content[{j}]: content part {kind!r} is not supported")
    return ordered if len(ordered) > len(parts) else "".join(parts)


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
            if role == "assistant":
                msg = assistant()
                msg["content"] += _content_text(item.get("content"), where)
            else:  # a developer message is the system prompt's voice to templates
                content = _content(item.get("content"), where, images=role == "user")
                out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise bad(f"{where}: function_call needs name and call_id", "input")
            msg = out[-1] if out and out[-1]["role"] == "assistant" and not reasoning else assistant()
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"},
            }
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
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        out.append(chat_tool(tool["name"], parameters, tool.get("description")))
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
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"], "strict": fmt.get("strict")},
        }
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
            raise bad(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}, got "
                      f"{effort!r}", "reasoning.effort")
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


# ---- reply: the result as a response object --------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def item_of(piece: Piece, item_id: str) -> dict[str, Any]:
    if isinstance(piece, ToolCall):
        return {
            "id": item_id,
            "type": "function_call",
            "status": "completed",
            "call_id": piece.id,
            "name": piece.name,
            "arguments": piece.arguments,
        }
    kind, text = piece
    if kind == "reasoning":
        return {
            "id": item_id,
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }
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
            "reasoning": body.get("reasoning") if isinstance(body.get("reasoning"),
                                                             dict) else {"effort": None, "summary": None},
            "store": False,
            "text": text,
            "truncation": "disabled",
            "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        }

    def response(
        self, status: str, output: list[dict[str, Any]], res: GenerationResult | None = None
    ) -> dict[str, Any]:
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
    output = [item_of(p, new_id(_prefix(p))) for p in whole_pieces(res, parser)]
    return shell.response(status_of(res), output, res)


