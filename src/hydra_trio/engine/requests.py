"""Which request parameters each entry point honours, ignores or refuses: the one request
policy of HTTP chat, HTTP text completions and DECODE (``check_request``), so a request is
never answered differently from what it asked for without being told. A DECODE's merged
layers (wire/sampling.py) meet the policy of the route its prompt segment has the shape of:
``messages`` are chat's, a ``prompt`` text completion's; one with no prompt (it continues
the slot) meets the rules every route shares.

- Honoured: handed to generation (engine/params.py parses the sampling and length keys and
  the output constraint: ``response_format``, llama-server's ``json_schema`` and
  ``grammar``, and ``tools``/``tool_choice``/``parallel_tool_calls`` (engine/chat/tools.py);
  ``logprobs`` is parsed here, as each route spells it its own way).
- Ignored: the parameters in ``IGNORED``, which change nothing this engine could do
  differently (docs/http-api.md lists them). Keys OpenAI does not define are ignored too, as
  llama-server and vLLM do, unless a known server's extension in ``_REFUSED`` asks for
  something this engine does not do.
- Refused: 400 naming the parameter, for anything else it cannot honour, and for a
  parameter of the other route (``prompt`` to chat, ``messages`` to text completions,
  and the other route's own keys unless null).
"""

from __future__ import annotations

from typing import Any, Literal

from ..wire.errors import bad_param
from .chat import BUDGET_KEYS
from .sample import MAX_TOP_LOGPROBS

Route = Literal["chat", "completions", "decode"]

# Accepted and ignored (docs/http-api.md lists them, with why).
IGNORED: dict[str, tuple[str, ...]] = {
    "chat": (
        "model", "user", "safety_identifier", "metadata", "service_tier",
        "store", "stream_options",
    ),
    "completions": (
        "model", "user", "safety_identifier", "metadata", "service_tier",
        "stream_options",
    ),
}

_CHAT_ONLY = ("messages", "tools", "tool_choice", "functions", "function_call", "top_logprobs", "reasoning_effort")
_COMPLETIONS_ONLY = ("prompt", "suffix", "echo", "best_of")


def _is_none(v: Any) -> bool:
    return v is None


def _neutral(*values: Any) -> Any:
    """A check that passes when the parameter asks for nothing: absent, null or one of
    ``values`` (compared with type, so ``True`` is not ``1``)."""
    return lambda v: v is None or any(type(v) is type(n) and v == n for n in values)


# Parameters refused unless they ask for nothing (name -> (check, why)). OpenAI's own first,
# then llama-server's and vLLM's extensions that would otherwise be silently ignored.
_REFUSED: dict[str, tuple[Any, str]] = {
    "logit_bias": (_neutral({}), "logit_bias is not supported"),
    "audio": (_is_none, "audio output is not supported"),
    "modalities": (_neutral(["text"]), "modalities other than [\"text\"] are not supported"),
    "prediction": (_is_none, "prediction (predicted outputs) is not supported"),
    "web_search_options": (_is_none, "web_search_options is not supported"),
    "verbosity": (_is_none, "verbosity is not supported"),
    "store": (_neutral(False), "store is not supported: completions are not stored"),
    # llama-server
    "n_probs": (_neutral(0), "n_probs is not supported: ask logprobs (and top_logprobs on chat)"),
    "mirostat": (_neutral(0), "mirostat is not supported"),
    "typical_p": (_neutral(1, 1.0), "typical_p is not supported"),
    "tfs_z": (_neutral(1, 1.0), "tfs_z is not supported"),
    "dynatemp_range": (_neutral(0, 0.0), "dynatemp_range is not supported"),
    "dry_multiplier": (_neutral(0, 0.0), "dry_multiplier is not supported"),
    "xtc_probability": (_neutral(0, 0.0), "xtc_probability is not supported"),
    "top_n_sigma": (_neutral(-1, -1.0), "top_n_sigma is not supported"),
    "samplers": (_is_none, "samplers (a custom sampler order) is not supported"),
    # vLLM
    "guided_json": (_is_none, "guided_json is not supported"),
    "guided_regex": (_is_none, "guided_regex is not supported"),
    "guided_choice": (_is_none, "guided_choice is not supported"),
    "guided_grammar": (_is_none, "guided_grammar is not supported"),
    "structured_outputs": (_is_none, "structured_outputs is not supported"),
    "use_beam_search": (_neutral(False), "use_beam_search is not supported"),
    "prompt_logprobs": (_is_none, "prompt_logprobs is not supported"),
}


MAX_CACHE_SALT_CHARS = 256  # a tenant's name or a hash of it; a key of every cache lookup


def cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's ``cache_salt`` (chat and completions): a non-empty string of at most
    MAX_CACHE_SALT_CHARS; None when absent or null."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise bad_param("cache_salt must be a non-empty string", "cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise bad_param(f"cache_salt is {len(salt)} characters; at most {MAX_CACHE_SALT_CHARS}", "cache_salt")
    return salt


def check_request(route: Route, body: dict[str, Any]) -> int | None:
    """Refuse (400 naming it) what ``route`` cannot honour; return the ``logprobs`` asked
    for: the number of top alternatives per token (0..20), or None when not asked."""
    if route == "decode":  # the shape of its prompt segment says which route's rules it meets
        route = "chat" if "messages" in body else "completions" if "prompt" in body else "decode"
    if route == "chat":
        if not isinstance(body.get("messages"), list):
            raise bad_param("messages is required (an array; a plain prompt goes to /v1/completions)", "messages")
        if "prompt" in body:
            raise bad_param("prompt is a /v1/completions parameter: chat takes messages", "prompt")
        for key in _COMPLETIONS_ONLY[1:]:
            if body.get(key) is not None:
                raise bad_param(f"{key} is a /v1/completions parameter, not supported on chat", key)
    elif route == "completions":
        for key in _CHAT_ONLY:
            if key in body if key == "messages" else body.get(key) is not None:
                hint = " (ask logprobs: N)" if key == "top_logprobs" else ""
                raise bad_param(f"{key} is a /v1/chat/completions parameter{hint}, not supported on "
                                "/v1/completions", key)
        for key in BUDGET_KEYS:  # a chat template's think block's: on a plain prompt it would do nothing
            if body.get(key) not in (None, -1):
                raise bad_param(f"{key} is a /v1/chat/completions parameter (a chat template's think block), not "
                                "supported on /v1/completions", key)
        if "prompt" not in body:
            raise bad_param("prompt is required", "prompt")
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise bad_param("echo must be a boolean", "echo")
        if echo and body.get("stream") and body.get("logprobs") not in (None, False):  # the prompt's come whole
            raise bad_param("echo with logprobs is not streamed: ask stream false", "echo")
        if body.get("suffix") not in (None, ""):
            raise bad_param("suffix is not supported", "suffix")
        if body.get("best_of") not in (None, 1) or isinstance(body.get("best_of"), bool):
            raise bad_param("best_of must be 1", "best_of")
    n = body.get("n")
    if n not in (None, 1) or isinstance(n, bool):
        raise bad_param("n must be 1 (one choice per request)", "n")
    for key, (asks_nothing, why) in _REFUSED.items():
        if key in body and not asks_nothing(body[key]):
            raise bad_param(why, key)
    _check_stream_options(body)
    _check_reasoning_effort(body)
    return _chat_logprobs(body) if route == "chat" else _completion_logprobs(body)


def _check_stream_options(body: dict[str, Any]) -> None:
    """``stream_options`` must be an object; its ``include_usage`` holds (every stream's last
    chunk carries usage). Beside ``stream: false`` it asks nothing (a reply has usage) and
    is ignored, not refused as OpenAI does: P/D routers turn a client's stream into a
    non-streaming prefill request and may leave it in."""
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_param("stream_options must be an object", "stream_options")


# OpenAI's reasoning_effort values: "none" turns the template's thinking off, the others are
# handed to it as reasoning_effort (gpt-oss's template reads it) (chat/render.py).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _check_reasoning_effort(body: dict[str, Any]) -> None:
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_param(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got "
                        f"{effort!r}", "reasoning_effort")


def _top_n(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOP_LOGPROBS:
        raise bad_param(f"{name} must be an integer between 0 and {MAX_TOP_LOGPROBS}", name)
    return v


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat: ``logprobs: true`` asks, ``top_logprobs`` (0..20) adds alternatives."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise bad_param("logprobs must be a boolean on chat (top_logprobs: N adds alternatives)", "logprobs")
    if top is not None:
        top = _top_n(top, "top_logprobs")
        if not lp:
            raise bad_param("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if lp else None


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    """Text completions: ``logprobs: N`` (0..20) asks, with N alternatives per token."""
    lp = body.get("logprobs")
    if lp is None or lp is False:
        return None
    return _top_n(lp, "logprobs")
