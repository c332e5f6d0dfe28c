"""A chat request rendered: messages checked and normalised, earlier tool calls and the
tools shown as the template can take them (``TemplateCaps``), then the prompt text through the
Jinja template or a llama.cpp built-in. HTTP chat, PREFILL and DECODE all render through
``PromptRenderer.render``, so they see the same text."""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import jinja2
import trio

from ...wire.errors import ErrorCode, ProtocolError, Status, bad_param
from ...wire.jsontext import parse_json
from .caps import PRESERVE_REASONING, TemplateCaps
from .formats import dump_arguments, generic_calls_json, tools_system_prompt
from .jinja import FALLBACK_TEMPLATE, TEMPLATE_GLOBALS, compile_template, date_context
from .templates import ChatTemplate
from .tools import ToolRequest, parse_tools

_ROLES = {"system", "user", "assistant", "tool", "developer"}
# Mistral Nemo's and Small 3.2's templates refuse a call id that is not 9 letters and digits
# (raise_exception with these words); clients send back the ids they were given (ours
# ``call_`` + 24 hex, Anthropic's ``toolu_...``, their own), so those are mapped (_nine_char_id).
_NINE_CHAR_IDS = "alphanumeric strings with length 9"
_ALNUM = string.ascii_letters + string.digits
T = TypeVar("T")


class ChatRequestError(ProtocolError):
    def __init__(self, message: str) -> None:
        # Valid JSON of the wrong shape: the caller's mistake, so BAD_REQUEST.
        super().__init__(ErrorCode.BAD_JSON, message, status=Status.BAD_REQUEST)


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatRequestError(f"messages[{index}].content: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatRequestError(f"messages[{index}].content must be a string or a list of text parts")


def normalise_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages must be a non-empty array")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatRequestError(f"messages[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:  # an object or array is unhashable
            raise ChatRequestError(f"messages[{i}].role must be one of {sorted(_ROLES)}")
        msg = dict(m)
        msg["content"] = _content_text(m.get("content"), i)
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise ChatRequestError(f"messages[{i}].tool_calls: only assistant messages carry tool calls")
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if role == "tool" and m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
            raise ChatRequestError(f"messages[{i}].tool_call_id must be a string")
        out.append(msg)
    return out


def _tool_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    """An assistant message's earlier tool calls, as OpenAI sends them back (id, type,
    function.name, function.arguments as JSON text), with the arguments also parsed: a
    template prints them one way or the other (``template_wants_object_arguments``)."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise ChatRequestError(f"{where} must be an array")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatRequestError(f"{where}[{j}] must be an object with function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                parsed = parse_json(args.encode("utf-8", "surrogatepass"), "arguments") if args.strip() else {}
            except ProtocolError:
                raise ChatRequestError(f"{where}[{j}].function.arguments is not JSON text") from None
        elif isinstance(args, dict):
            parsed, args = args, dump_arguments(args)
        else:
            raise ChatRequestError(f"{where}[{j}].function.arguments must be a string of JSON")
        out.append({
            "id": call.get("id") if isinstance(call.get("id"), str) else f"call_{index}_{j}",
            "type": "function",
            "function": {"name": fn["name"], "arguments": args},
            "_arguments_object": parsed,
        })
    return out


def tool_messages(
    messages: list[dict[str, Any]], caps: TemplateCaps, tools: ToolRequest | None, *, source: str = ""
) -> list[dict[str, Any]]:
    """The messages a template renders, shaped as llama-server hands them to it: role,
    content, reasoning_content, name, tool_call_id and tool_calls (type, function, id), with a
    call's arguments as an object where the template reads them so (``caps.object_arguments``),
    else the JSON text; developer turns as system ones (except for gpt-oss's harmony, which has
    its own); a system message merged into the next where the template drops it. For the
    generic format (``caps.describes_tools``) the tools and the reply form are described in a
    system message first, and earlier calls a template cannot print are written as that form's
    JSON in the assistant's content."""
    wants_object, renders_calls = caps.object_arguments, caps.renders_tool_calls
    keep_developer = "<|channel|>" in source
    call_id: Callable[[str], str] = _nine_char_id if _NINE_CHAR_IDS in source else str
    out = []
    for m in messages:
        role = "system" if m["role"] == "developer" and not keep_developer else m["role"]
        msg: dict[str, Any] = {"role": role, "content": m["content"]}
        for key in ("reasoning_content", "name", "tool_call_id"):
            if isinstance(m.get(key), str) and m[key]:
                msg[key] = call_id(m[key]) if key == "tool_call_id" else m[key]
        calls = m.get("tool_calls")
        if calls:
            if renders_calls or not caps.describes_tools:
                msg["tool_calls"] = [
                    {"type": "function",
                     "function": {"name": c["function"]["name"],
                                  "arguments": c["_arguments_object"] if wants_object else c["function"]["arguments"]},
                     "id": call_id(c["id"])}
                    for c in calls
                ]
            else:
                msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + generic_calls_json(
                    [(c["function"]["name"], c["_arguments_object"]) for c in calls]
                )
        out.append(msg)
    if not caps.system_role and out and out[0]["role"] == "system":
        first = out.pop(0)
        if out:  # llama.cpp's workaround: the system text opens the next message
            out[0] = {**out[0], "content": first["content"] + "\n" + out[0]["content"]}
    # ChatML and the built-ins have no tool-call syntax and may not list the tools: the system
    # message teaches the generic form.
    if tools is not None and tools.choice != "none" and caps.describes_tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return _as_handler_gives(out, source)


def _nine_char_id(call_id: str) -> str:
    """A call id as a template that takes only 9 letters and digits needs it: kept when it
    is one, else 9 of them from its hash, so a call and its result still pair, and the same
    id gives the same prompt every turn (the prefix cache). vLLM keeps the last 9 characters
    instead, which fails on ids with other characters there; llama-server passes the id as
    it is, and the template refuses the turn."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    n = int.from_bytes(hashlib.blake2b(call_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")
    out = []
    for _ in range(9):
        n, k = divmod(n, len(_ALNUM))
        out.append(_ALNUM[k])
    return "".join(out)


def _as_handler_gives(messages: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """The messages as llama.cpp's specialised handler for ``source`` reshapes them, for the
    two templates whose handler changes what the template reads (llama.cpp's own detection,
    common/chat.cpp ``common_chat_try_specialized_template``): LFM2 and LFM2.5 read an earlier
    turn's reasoning as ``thinking`` (common/parsers/lfm2.cpp); Ministral / Magistral Large 3
    read system and assistant content as blocks, the reasoning a ``thinking`` block first
    (common/parsers/ministral3.cpp); Gemma 4's older templates read a call's results from the
    model turn (``_gemma4_model_turns``). gpt-oss's copy is harmony.py's."""
    lfm2 = ("<|tool_list_start|>" in source and "<|tool_list_end|>" in source) or (
        "List of tools: [" in source and "<|tool_list_start|>" not in source
    )
    ministral3 = all(k in source for k in ("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]")) and "[CALL_ID]" not in source
    if "'<|tool_call>call:'" in source and "{#- OpenAI Chat Completions:" not in source:
        return _gemma4_model_turns(messages)
    if lfm2:
        return [{**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else m for m in messages]
    if not ministral3:
        return messages
    out = []
    for m in messages:
        if m["role"] not in ("system", "assistant"):
            out.append(m)
            continue
        blocks: list[dict[str, Any]] = []
        if "reasoning_content" in m:
            blocks.append({"type": "thinking", "thinking": m["reasoning_content"]})
        content = m.get("content")
        blocks.extend(content if isinstance(content, list) else [{"type": "text", "text": content or ""}])
        out.append({**{k: v for k, v in m.items() if k != "reasoning_content"}, "content": blocks})
    return out


def _gemma4_model_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """llama.cpp's workaround for Gemma 4's older templates (common/parsers/gemma4.cpp):
    an assistant turn with calls, the ``tool`` results after it and the assistant's plain
    reply after those become one assistant message with ``tool_responses`` (each
    ``{name, response}``: the result parsed as JSON where it is JSON, named after its call)."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        if m["role"] != "assistant" or not m.get("tool_calls"):
            out.append(m)
            i += 1
            continue
        calls, responses = list(m["tool_calls"]), []
        i += 1
        while i < len(messages) and messages[i]["role"] == "tool":
            result = messages[i].get("content")
            try:
                response = json.loads(result) if isinstance(result, str) else result
            except ValueError:
                response = result
            name = calls[len(responses)]["function"]["name"] if len(responses) < len(calls) else ""
            responses.append({"name": name or messages[i].get("tool_call_id", ""), "response": response})
            i += 1
        turn: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
        if responses:
            turn["tool_responses"] = responses
        if (
            i < len(messages)
            and messages[i]["role"] == "assistant"
            and not messages[i].get("tool_calls")
            and messages[i].get("content")
        ):
            turn["content"] = messages[i]["content"]
            i += 1
        if "reasoning_content" in m:
            turn["reasoning_content"] = m["reasoning_content"]
        out.append(turn)
    return out


def template_tools(tools: ToolRequest) -> list[dict[str, Any]]:
    """The tools as llama-server gives them to a template: type, then function with name,
    description ("" when none) and parameters, in that order (templates print them)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.parameters}} for t in tools.tools]


def template_kwargs(request: dict[str, Any], caps: TemplateCaps) -> dict[str, Any]:
    """The variables llama-server adds to a template's context: ``enable_thinking``
    (``thinking_on``), ``preserve_reasoning`` (on by default, with the spellings templates
    read: ``preserve_thinking``, ``clear_thinking``, ...), ``reasoning_effort`` from the
    request, and every key of ``chat_template_kwargs``."""
    given = _template_kwargs_given(request)
    thinking = thinking_on(request, caps)
    out: dict[str, Any] = {}
    preserve = given.get("preserve_reasoning", True)
    if isinstance(preserve, bool):
        out.update({k: (v if preserve else not v) for k, v in PRESERVE_REASONING.items()})
    effort = request.get("reasoning_effort")
    if isinstance(effort, str) and effort and effort != "none":
        out["reasoning_effort"] = out["reasoning_strength"] = effort
    out.update({"enable_thinking": thinking, **date_context(), "preserve_reasoning": preserve, **given})
    out["enable_thinking"] = thinking
    return out


# The request keys of a thinking budget (llama-server's, and its alias): the engine writes the
# budget in force (a request's, else --reasoning-budget) under the first before rendering.
BUDGET_KEYS = ("reasoning_budget_tokens", "thinking_budget_tokens")


def thinking_on(request: dict[str, Any], caps: TemplateCaps) -> bool:
    """The one decision of whether a request thinks (the template's ``enable_thinking``):
    ``chat_template_kwargs.enable_thinking``, else the template's default (on where it has a
    reasoning form, as llama-server); ``reasoning_effort: "none"`` and a thinking budget of 0
    turn it off whatever the kwargs say."""
    thinking = _template_kwargs_given(request).get("enable_thinking", caps.thinking_default)
    if not isinstance(thinking, bool):
        raise ChatRequestError("chat_template_kwargs.enable_thinking must be a boolean")
    budget = next((request[k] for k in BUDGET_KEYS if request.get(k) is not None), None)
    if request.get("reasoning_effort") == "none" or (budget == 0 and not isinstance(budget, bool)):
        return False
    return thinking


# What the engine itself gives a template, from the request it checked: a template kwarg that set
# one would replace it (``messages`` past a gateway that filters them, ``tools`` never parsed,
# the special tokens), so none may. The dates and the reasoning switches are the kwargs' to set.
RENDERED_VARIABLES = (
    frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}) | TEMPLATE_GLOBALS
)


def _template_kwargs_given(request: dict[str, Any]) -> dict[str, Any]:
    given = request.get("chat_template_kwargs")
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise ChatRequestError("chat_template_kwargs must be an object")
    if taken := sorted(RENDERED_VARIABLES.intersection(given)):
        raise bad_param(
            f"chat_template_kwargs may not set {', '.join(taken)}: the engine renders "
            f"{'it' if len(taken) == 1 else 'them'} from the request itself",
            f"chat_template_kwargs.{taken[0]}",
        )
    return given


def render_prompt(
    request: dict[str, Any], template: str | None, caps: TemplateCaps, *, bos_token: str, eos_token: str
) -> str:
    """Prompt text for a request with ``messages`` (through the Jinja ``template``, ChatML
    when None) or a plain ``prompt`` (used verbatim). The template sees what llama-server
    gives it: the messages, ``bos_token``, ``eos_token``, ``tools`` only when there are some,
    today's ``date_string`` and ``datetime``, ``add_generation_prompt`` and the reasoning
    switches and ``chat_template_kwargs`` (``template_kwargs``)."""
    if "messages" in request:
        messages = normalise_messages(request["messages"])
        add_gen = _add_generation_prompt(request)
        tool_request = parse_tools(request)
        kwargs = template_kwargs(request, caps)
        source = template or FALLBACK_TEMPLATE
        messages = tool_messages(messages, caps, tool_request, source=source)
        context: dict[str, Any] = {"messages": messages, "bos_token": bos_token, "eos_token": eos_token, **kwargs}
        if tool_request is not None and tool_request.tools:
            context["tools"] = template_tools(tool_request)
        context["add_generation_prompt"] = add_gen
        try:
            text = compile_template(source).render(**context)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatRequestError(f"chat template failed: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # A template that cannot take this conversation (it iterates text, indexes past
            # the end): the request's shape for this model, not our fault, so a 400 naming it.
            raise ChatRequestError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        return text
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return prompt
    raise ChatRequestError("request needs 'messages' (array) or 'prompt' (string)")


def _add_generation_prompt(request: dict[str, Any]) -> bool:
    add_gen = request.get("add_generation_prompt", True)
    if not isinstance(add_gen, bool):
        raise ChatRequestError("add_generation_prompt must be a boolean")
    return add_gen


RunOnWorker = Callable[[Callable[[], str]], Awaitable[str]]
ApplyBuiltin = Callable[[str, Sequence[tuple[str, str]], bool], str]
# A request of more messages (and content parts, tools) than this is rendered on a thread: its
# normalising and the template's loop hold the GIL in 5 ms turns there, where on the event loop
# they held every stream for the whole render (130,000 tiny messages: ~1 s). Two at once.
RENDER_INLINE_ITEMS = 256
RENDER_THREADS = 2


def _items(request: dict[str, Any]) -> int:
    """About how many things the render walks (a bounded count: it stops past the bound)."""
    messages, tools = request.get("messages"), request.get("tools")
    n = (len(messages) if isinstance(messages, list) else 0) + (len(tools) if isinstance(tools, list) else 0)
    if n > RENDER_INLINE_ITEMS or not isinstance(messages, list):
        return n
    return n + sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))


class PromptRenderer:
    """Request (``messages`` or a plain ``prompt``) -> prompt text with the engine's template.

    Jinja renders on the trio thread (pure Python); a built-in template is a llama.cpp call,
    so it runs on the GPU worker (``run_on_worker``)."""

    def __init__(
        self,
        template: ChatTemplate,
        caps: TemplateCaps,
        *,
        bos_token: str,
        eos_token: str,
        tokenizer_adds_bos: bool,
        run_on_worker: RunOnWorker,
        apply_builtin: ApplyBuiltin,
    ) -> None:
        self.template = template
        self._caps = caps
        self._bos = bos_token
        self._eos = eos_token
        # Prompts are tokenized with add_special: when the tokenizer adds BOS itself, a
        # template's own leading BOS text would make two (llama-server strips it the same way).
        self._strip_bos = tokenizer_adds_bos and bool(bos_token)
        self._run = run_on_worker
        self._apply_builtin = apply_builtin
        self._threads = trio.CapacityLimiter(RENDER_THREADS)

    async def render(self, request: dict[str, Any]) -> str:
        tpl, caps = self.template, self._caps
        if "messages" not in request or tpl.jinja is not None:

            def jinja() -> str:
                text = render_prompt(request, tpl.jinja, caps, bos_token=self._bos, eos_token=self._eos)
                return text.removeprefix(self._bos) if self._strip_bos and "messages" in request else text

            return await self._off_loop(jinja, request)
        builtin = tpl.builtin
        assert builtin is not None

        def role_contents() -> list[tuple[str, str]]:
            _template_kwargs_given(request)  # refused as for a Jinja template, though a built-in reads none
            # A built-in renders role and content only: tools are described in a system message
            # and earlier calls written as the generic format's JSON (``tool_messages``).
            messages = tool_messages(normalise_messages(request["messages"]), caps, parse_tools(request))
            return [(m["role"], m["content"]) for m in messages]

        pairs = await self._off_loop(role_contents, request)
        add_gen = _add_generation_prompt(request)
        try:
            return await self._run(lambda: self._apply_builtin(builtin, pairs, add_gen))
        except ValueError as exc:
            raise ChatRequestError(str(exc)) from None

    async def _off_loop(self, fn: Callable[[], T], request: dict[str, Any]) -> T:
        """``fn()`` inline for a small request, on a thread (RENDER_THREADS at once) for a large one."""
        if _items(request) <= RENDER_INLINE_ITEMS:
            return fn()
        return await trio.to_thread.run_sync(fn, limiter=self._threads)
