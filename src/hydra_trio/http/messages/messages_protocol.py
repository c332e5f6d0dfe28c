"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) as a
codec at the edge: the request becomes the internal chat request (``to_chat``), runs the one
chat pipeline /v1/chat/completions runs (engine.prepare: template, tools and their grammar,
reasoning split, prefix cache, cache_salt, limits; http/generation/generation.py: claim,
generate, logs, metrics), and the result is shaped back as a message (``message_body``) or
as Anthropic's event stream (http/messages/messages_serving.py).

Every error on /v1/messages* (ours, the auth check's, the drain's, a 404) leaves in
Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}`` (``error_reply``).
docs/http-api.md lists what is mapped, ignored and refused."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...engine import GenerationResult, ReplyParser, ToolCall
from ..generation import Piece, chat_tool, dialect_names, receipt_fields, whole_pieces
from ..plumbing import HttpError

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

# Claude Code's first system block: a line that changes with every request. Rendered, it
# would end the cached prefix at the system prompt's start; it tells the model nothing.
BILLING_HEADER = "x-anthropic-billing-header:"
# Accepted and ignored (docs/http-api.md names each): nothing here could honour them.
IGNORED = (
    "model", "metadata", "context_management", "service_tier", "container", "mcp_servers", "betas",
    "anthropic_version", "cache_control", "inference_geo",
)


def bad(message: str) -> HttpError:
    return HttpError(400, message, "invalid_request_error")


# ---- request: Messages -> the internal chat request ------------------------------------------


def _system_text(system: Any) -> str:
    """``system`` as one text: a string, or text blocks joined by blank lines, with Claude
    Code's billing-header line dropped (it would defeat the prefix cache)."""
    if system is None:
        return ""
    if isinstance(system, str):
        blocks = [system]
    elif isinstance(system, list):
        blocks = []
        for i, block in enumerate(system):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise bad(f"system[{i}] must be a text block")
            blocks.append(block["text"])
    else:
        raise bad("system must be a string or an array of text blocks")
    kept = []
    for text in blocks:
        lines = [ln for ln in text.split("\n") if not ln.startswith(BILLING_HEADER)]
        if any(ln.strip() for ln in lines):
            kept.append("\n".join(lines))
    return "\n\n".join(kept)


def _text_of(content: Any, where: str) -> str:
    """A tool_result's content: a string, or text and tool_reference blocks (each reference a
    line naming the tool: the model reads that its definition is now among the tools)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or an array of text blocks")
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("image", "document"):
            raise bad(f"{where}.content[{j}]: {kind} blocks are not supported (this server has no multimodal model)")
        if kind == "tool_reference":  # a tool search's result (Claude Code's ToolSearch): the tool it loaded
            if not isinstance(block.get("tool_name"), str):
                raise bad(f"{where}.content[{j}]: tool_reference needs tool_name")
            parts.append(f"Tool loaded: {block['tool_name']}")
            continue
        if kind != "text" or not isinstance(block.get("text"), str):
            raise bad(f"{where}.content[{j}] must be a text block")
        parts.append(block["text"])
    return "\n".join(parts)


def _image_part(source: Any, where: str) -> dict[str, Any]:
    """An image block's source as OpenAI's ``image_url`` part: base64 data as a data: URI,
    a URL as it is (the engine decides which URLs it reads)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return {"type": "image_url", "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise bad(f"{where}.source must be {{type: base64, media_type, data}} or {{type: url, url}}")


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty array")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise bad(f"{where} must be an object with role 'user', 'assistant' or 'system'")
        role, content = m["role"], m.get("content")
        if role == "system":  # Claude Code sends these between turns (agent lists, reminders)
            out.append({"role": "system", "content": _text_of(content, where)})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"{where}.content must be a string or an array of content blocks")
        texts: list[str] = []
        parts: list[dict[str, Any]] = []  # texts and images in order, when a user turn has images
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        thinking: list[str] = []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                parts.append({"type": "text", "text": ("\n" if texts else "") + block["text"]})
                texts.append(block["text"])
            elif kind == "image" and role == "user":
                parts.append(_image_part(block.get("source"), at))
            elif kind in ("image", "document", "search_result"):
                raise bad(f"{at}: {kind} blocks are not supported (this server has no multimodal model)")
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
                    raise bad(f"{at}: tool_use needs id and name")
                args = block.get("input", {})
                calls.append(
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": json.dumps(args)},
                    }
                )
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad(f"{at}: tool_result needs tool_use_id")
                text = _text_of(block.get("content"), at)
                if block.get("is_error"):
                    text = f"Error: {text}"
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
            elif kind == "thinking" and role == "assistant":
                thinking.append(str(block.get("thinking") or ""))
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # encrypted by another server: nothing a template could show
            else:
                raise bad(f"{at}: a {kind!r} block is not supported in a {role} message")
        if role == "user":
            out.extend(results)  # the results answer the calls just before; the text follows
            if len(parts) > len(texts):  # images: the parts in order (engine/media.py reads them)
                out.append({"role": "user", "content": parts})
            elif texts or not results:
                out.append({"role": "user", "content": "\n".join(texts)})
        else:
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "".join(thinking)
            out.append(msg)
    return out


def _kept_tools(body: dict[str, Any]) -> tuple[list[int], list[str]]:
    """Which of the request's tools the model is offered (their indexes), and the server tools
    dropped (this server cannot run them: web_search, bash...). A tool with ``defer_loading``
    is offered only once loaded, as Anthropic's tool search has it: named by a
    ``tool_reference`` block (a ToolSearch result), called in the history, or forced by
    ``tool_choice``; until then the model does not see it (Claude Code's
    DeferredToolPlaceholder, "never call this tool", is never loaded)."""
    raw = body.get("tools")
    if raw is None:
        return [], []
    if not isinstance(raw, list):
        raise bad("tools must be an array")
    loaded = _loaded_tools(body)
    kept, dropped = [], []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise bad(f"tools[{i}] must be an object with a name")
        if tool.get("type") not in (None, "custom") or "input_schema" not in tool:
            dropped.append(str(tool.get("type") or tool["name"]))
        elif tool.get("defer_loading") is not True or tool["name"] in loaded:
            kept.append(i)
    return kept, dropped


def _loaded_tools(body: dict[str, Any]) -> set[str]:
    """The deferred tools the conversation has loaded (see _kept_tools); read after the
    messages are checked, defensively all the same."""
    names: set[str] = set()
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("name"), str):
        names.add(choice["name"])
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        for block in content if isinstance(content, list) else ():
            if not isinstance(block, dict):
                continue
            if block.get("type") == "tool_use" and isinstance(block.get("name"), str):
                names.add(block["name"])
            inner = block.get("content") if block.get("type") == "tool_result" else None
            for ref in inner if isinstance(inner, list) else ():
                name = ref.get("tool_name") if isinstance(ref, dict) and ref.get("type") == "tool_reference" else None
                if isinstance(name, str):
                    names.add(name)
    return names


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    if body.get("tools") is None:
        return None
    kept, dropped = _kept_tools(body)
    if dropped:
        log.info("/v1/messages: dropped tools this server cannot run: %s", ", ".join(dropped))
    raw = body["tools"]
    return [chat_tool(raw[i]["name"], raw[i]["input_schema"], raw[i].get("description")) for i in kept]


def _tool_choice(raw: Any) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if raw is None:
        return None, None
    if not isinstance(raw, dict):
        raise bad("tool_choice must be an object with a type")
    parallel = False if raw.get("disable_parallel_tool_use") else None
    kind = raw.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}, parallel
    raise bad("tool_choice.type must be auto, any, tool (with name) or none")


def param_names(body: dict[str, Any]) -> Callable[[str], str]:
    """The Messages API's names of the chat request's parameters (a refusal names what the
    client sent: ``tools[14].input_schema``, the request's own index past a dropped server
    tool; ``output_format``)."""
    kept, _ = _kept_tools(body)
    fmt = (
        "output_config.format"
        if isinstance(body.get("output_config"), dict) and body["output_config"].get("format")
        else "output_format"
    )
    return dialect_names(
        kept,
        ((".function.parameters", ".input_schema"), (".function", "")),
        (
            ("response_format.json_schema.schema", fmt + ".schema"), ("response_format", fmt),
            ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"), ("stop", "stop_sequences"),
            ("reasoning_budget_tokens", "thinking.budget_tokens"),
        ),
    )


def to_chat(body: dict[str, Any], *, count_only: bool = False) -> dict[str, Any]:
    """A Messages request as the internal chat request (400 for what cannot be mapped)."""
    messages = _messages(body.get("messages"))
    system = _system_text(body.get("system"))
    chat: dict[str, Any] = {"messages": ([{"role": "system", "content": system}] if system else []) + messages}
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
        choice, parallel = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            chat["tool_choice"] = choice
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive", "disabled"):
        # The template's thinking switch (templates without one ignore it).
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}
        budget = thinking.get("budget_tokens") if thinking["type"] == "enabled" else None
        if budget is not None:  # llama-server's mapping: the thinking budget of the reply
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise bad("thinking.budget_tokens must be a positive integer")
            chat["reasoning_budget_tokens"] = budget
    for key in ("cache_salt", "lora"):  # vLLM's salt, llama-server's adapter list
        if key in body:
            chat[key] = body[key]
    if count_only:
        return chat
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad("max_tokens is required: a positive integer")
    chat["max_tokens"] = max_tokens
    for key in ("temperature", "top_p", "top_k", "stream"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    fmt = (body.get("output_config") or {}).get("format") if isinstance(body.get("output_config"), dict) else None
    fmt = fmt or body.get("output_format")  # structured outputs (a beta), under either name
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return chat


# ---- reply: the result as a message, and the error shape ----------------------------------------


def stop_reason(res: GenerationResult, pieces_have_calls: bool, stop: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation; a cut turn is paused (its
    receipt says what stays: a request that continues it resumes from there)."""
    if res.stop_type == "cancelled":
        return "pause_turn", None
    if res.stop_type in ("limit", "context"):
        return "max_tokens", None
    if pieces_have_calls:
        return "tool_use", None
    if res.stop_type == "word" and res.stopping_word in stop:
        return "stop_sequence", res.stopping_word
    return "end_turn", None


def usage(res: GenerationResult) -> dict[str, Any]:
    # Anthropic counts cached prompt tokens apart: input_tokens are the ones computed.
    return {
        "input_tokens": res.prompt_tokens - res.n_common,
        "output_tokens": res.completion_tokens,
        "cache_read_input_tokens": res.n_common,
        "cache_creation_input_tokens": 0,
    }


def _tool_input(call: ToolCall) -> Any:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return {}


def block_of(piece: Piece) -> dict[str, Any]:
    if isinstance(piece, ToolCall):
        return {"type": "tool_use", "id": call_id(piece), "name": piece.name, "input": _tool_input(piece)}
    kind, text = piece
    return (
        {"type": "thinking", "thinking": text, "signature": ""}
        if kind == "reasoning"
        else {"type": "text", "text": text}
    )


def call_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def message_body(
    mid: str, model: str, res: GenerationResult, parser: ReplyParser | None, stop: list[str]
) -> dict[str, Any]:
    pieces = whole_pieces(res, parser)
    reason, sequence = stop_reason(res, any(isinstance(p, ToolCall) for p in pieces), stop)
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [block_of(p) for p in pieces],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(res),
        **receipt_fields(res),
    }


def error_reply(status: int, err: dict[str, Any]) -> dict[str, Any]:
    """An error in Anthropic's shape from OpenAI's error object (every route's): a prompt that
    does not fit is "prompt is too long" (what Claude Code compacts its conversation on)."""
    message = str(err["message"])
    if err.get("code") == "context_length_exceeded":
        message = f"prompt is too long: {message}"
    return error_shape(status, message)


def error_shape(status: int, message: str) -> dict[str, Any]:
    kind = {
        400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
        408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
        504: "timeout_error",
    }.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


