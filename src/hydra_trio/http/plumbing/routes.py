"""Every HTTP route's facts, in one table: who may call it (its auth role, for every method it
serves, HEAD as GET), what body it takes (none, a small JSON object up to 4 KiB, JSON up to
--max-json-bytes, a KV blob up to --max-kv-bytes), and whether it starts new work (refused while draining, with the one
"busy, retry" reply). The auth check, the body caps, the drain and the upload gate all read it; a
test holds it to the app's own routes (tests/http/test_http_routes.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Literal

Body = Literal["none", "small", "json", "kv"]
SMALL_BODY_BYTES = 4096  # a "small" body: a JSON object nothing is read from (erase's {})


class Role(IntEnum):
    NONE = 0  # what /health needs: load balancers probe it without credentials
    PLAIN = 1  # completions, chat, tokenizer routes, a decode result by its id, /metrics
    ADMIN = 2  # slot state, erase, /slots, the decode listing


@dataclass(frozen=True, slots=True)
class Route:
    rule: str  # Quart's URL rule
    method: str
    role: Role
    body: Body = "none"
    new_work: bool = False  # starts generation: refused (503, Retry-After) while draining
    path: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The rule's concrete paths: a <variable> is one path segment.
        object.__setattr__(self, "path", re.compile(re.sub(r"<[^>]+>", "[^/]+", self.rule)))


ROUTES: tuple[Route, ...] = (
    Route("/health", "GET", Role.NONE),
    Route("/version", "GET", Role.PLAIN),
    Route("/metrics", "GET", Role.PLAIN),
    Route("/v1/models", "GET", Role.PLAIN),
    # llama-server's router routes (http/models/model_routes.py): loading and unloading is the operator's.
    Route("/models", "GET", Role.PLAIN),
    Route("/models/load", "POST", Role.ADMIN, "small", new_work=True),
    Route("/models/unload", "POST", Role.ADMIN, "small"),
    Route("/v1/chat/completions", "POST", Role.PLAIN, "json", new_work=True),
    Route("/v1/completions", "POST", Role.PLAIN, "json", new_work=True),
    Route("/infill", "POST", Role.PLAIN, "json", new_work=True),  # llama-server's fill-in-the-middle
    # The agents' dialects (Anthropic Messages, OpenAI Responses): codecs over chat.
    Route("/v1/messages", "POST", Role.PLAIN, "json", new_work=True),
    Route("/v1/messages/count_tokens", "POST", Role.PLAIN, "json"),
    Route("/v1/responses", "POST", Role.PLAIN, "json", new_work=True),
    Route("/v1/responses/input_tokens", "POST", Role.PLAIN, "json"),
    # Pooled requests on the embedding context (bodies of many inputs: --max-json-bytes).
    Route("/v1/embeddings", "POST", Role.PLAIN, "json", new_work=True),
    Route("/embeddings", "POST", Role.PLAIN, "json", new_work=True),
    Route("/v1/rerank", "POST", Role.PLAIN, "json", new_work=True),
    Route("/rerank", "POST", Role.PLAIN, "json", new_work=True),
    Route("/v1/reranking", "POST", Role.PLAIN, "json", new_work=True),
    Route("/reranking", "POST", Role.PLAIN, "json", new_work=True),
    Route("/v1/chat/completions/render", "POST", Role.PLAIN, "json"),
    Route("/v1/completions/render", "POST", Role.PLAIN, "json"),
    Route("/tokenize", "POST", Role.PLAIN, "json"),
    Route("/detokenize", "POST", Role.PLAIN, "json"),
    Route("/tokenizer_info", "GET", Role.PLAIN),
    Route("/apply-template", "POST", Role.PLAIN, "json"),
    # vllm-router's: an agent session is over (scoped by the caller's key and cache_salt).
    Route("/finish_session", "POST", Role.PLAIN, "small"),
    Route("/lora-adapters", "GET", Role.PLAIN),
    Route("/lora-adapters", "POST", Role.ADMIN, "json"),  # every request's default adapter set
    Route("/v1/decode", "GET", Role.ADMIN),  # every decode id: the ids are the results' capabilities
    Route("/v1/decode/<raw_id>", "GET", Role.PLAIN),
    Route("/v1/decode/<raw_id>", "DELETE", Role.PLAIN),
    Route("/slots", "GET", Role.ADMIN),  # other clients' request ids
    Route("/slots/<raw_id>", "POST", Role.ADMIN, "small"),  # ?action=erase; llama-server's clients send {}
    Route("/slots/<raw_id>/state", "GET", Role.ADMIN),  # another user's prompt
    Route("/slots/<raw_id>/state", "PUT", Role.ADMIN, "kv"),  # KV others would reuse
    Route("/slots/<raw_id>/state/meta", "GET", Role.ADMIN),
)

_BY_RULE = {(r.rule, r.method): r for r in ROUTES}


def _method(method: str) -> str:
    return "GET" if method == "HEAD" else method  # HEAD is GET without the body: the same facts


def by_rule(rule: str | None, method: str) -> Route | None:
    """The route Quart matched (``rule``) for ``method``; None: no such route (a 404 or 405)."""
    return None if rule is None else _BY_RULE.get((rule, _method(method)))


def by_path(method: str, path: str) -> Route | None:
    """The route a request's path and method reach, before routing (the ASGI wrappers)."""
    method = _method(method)
    for route in ROUTES:
        if route.method == method and route.path.fullmatch(path):
            return route
    return None


def role_of(rule: str | None, method: str) -> Role:
    """The role a request needs. A rule with no entry for the method (a 405 to come) needs
    the strictest role any method of it needs; no rule at all (a 404): the plain role, so
    that unmatched paths tell strangers nothing."""
    route = by_rule(rule, method)
    if route is not None:
        return route.role
    roles = [r.role for r in ROUTES if r.rule == rule]
    return max(roles, default=Role.PLAIN)
