"""Who may call which HTTP route: the API keys (OpenAI / llama-server convention:
``Authorization: Bearer KEY``), their roles, and the startup warning for an exposed bind.

Two roles (docs/operations.md "Roles"). The admin key (--admin-api-key) serves every route;
the plain key (--api-key) serves every route but the admin ones: slot state GET/PUT and its
meta, erase, /slots (other clients' request ids) and the decode listing. ``access`` is the
one decision; the rest only feeds it. Which role a route needs is http/plumbing/routes.py's table.

Which keys are set decides what a request without a valid key gets (``KeyRing.anonymous``):
neither key: everything (HTTP open, as before keys); --api-key alone: nothing, and that key
is admin (deployments from before roles keep working unchanged); --admin-api-key alone: the
plain routes (no plain key was asked for), admin routes need the admin key; both: nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import TYPE_CHECKING, Any

from quart import Response, g, request

from ...config import is_loopback
from .common import json_response
from .routes import Role, role_of
from .sse import error_body

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from ...serving import AppState

log = logging.getLogger(__name__)

# A request's tenant is the key it was served with: "admin" or "plain" (a key of that role),
# or OPEN_TENANT (no key needed, or none given). Agent sessions are scoped by it
# (http/plumbing/session_hints.py), so two keys never share a session.
OPEN_TENANT = "open"


def request_tenant() -> str:
    """The tenant of the request being handled (``OPEN_TENANT`` without keys)."""
    return str(g.get("hydra_tenant", OPEN_TENANT))


def _digest(key: str) -> bytes:
    # Compared as digests: compare_digest is constant-time for equal lengths, and digests
    # make the length of the key irrelevant too.
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """The configured keys, each with the role it grants, and the role of a request that
    presents none of them."""

    def __init__(self, plain: str | None, admin: str | None) -> None:
        keys: list[tuple[bytes, Role]] = []
        if admin is not None:
            keys.append((_digest(admin), Role.ADMIN))
        if plain is not None:
            # Alone, the one key keeps the whole engine it always opened.
            keys.append((_digest(plain), Role.PLAIN if admin is not None else Role.ADMIN))
        self._keys = keys
        if plain is None and admin is None:
            self.anonymous = Role.ADMIN
        elif plain is None:
            self.anonymous = Role.PLAIN
        else:
            self.anonymous = Role.NONE

    def role_of(self, token: str) -> Role | None:
        """The role ``token`` grants; None when it is no configured key."""
        given = _digest(token)
        found = None
        for digest, role in self._keys:  # every key compared: the time tells nothing of which
            if hmac.compare_digest(given, digest):
                found = role
        return found


def access(needed: Role, ring: KeyRing, authorization: str) -> tuple[int, str] | None:
    """The auth decision of every HTTP request: None to serve it, else (401 or 403, message).
    401: no valid key where one is needed; 403: a valid key whose role is not enough (the
    client is known, the route is not theirs)."""
    token = bearer_token(authorization)
    granted = ring.role_of(token) if token is not None else None
    if max(ring.anonymous, granted or Role.NONE) >= needed:
        return None
    if granted is None:
        if token is None:
            return 401, "missing API key: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')"
        return 401, "invalid API key"
    return 403, "this route needs the admin API key (--admin-api-key): slot state, erase, /slots and the decode listing"


def install_auth(app: QuartTrio, state: AppState) -> None:
    settings = state.settings
    plain, admin = settings.http_api_key(), settings.http_admin_api_key()
    if not is_loopback(settings.host):
        if plain is None and admin is None:
            log.warning(
                "HTTP binds %s without an API key: anyone who reaches the port can use every "
                "route (set --api-key-file or HYDRA_API_KEY)",
                settings.host,
            )
        elif plain is None:
            log.warning(
                "HTTP binds %s with only an admin key: completions, chat and the tokenizer routes "
                "need no key (set --api-key-file or HYDRA_API_KEY to require one)",
                settings.host,
            )
    if plain is None and admin is None:
        return
    ring = KeyRing(plain, admin)

    @app.before_request
    async def require_api_key() -> Response | None:
        rule = request.url_rule.rule if request.url_rule is not None else None
        authorization = authorization_of(request.headers)
        refused = access(role_of(rule, request.method), ring, authorization)
        if refused is None:
            token = bearer_token(authorization)
            granted = ring.role_of(token) if token is not None else None
            g.hydra_tenant = OPEN_TENANT if granted is None else granted.name.lower()
            return None
        status, message = refused
        if status == 401:
            state.metrics.http_auth_rejected.inc()
            return json_response(error_body(401, message, "authentication_error"), 401, {"WWW-Authenticate": "Bearer"})
        state.metrics.http_auth_forbidden.inc()
        return json_response(error_body(403, message, "permission_error"), 403)


def authorization_of(headers: Any) -> str:
    """The request's credentials as an Authorization header: ``Authorization: Bearer KEY``,
    else Anthropic's ``x-api-key: KEY`` (what the anthropic SDK and Claude Code send)."""
    auth = headers.get("Authorization", "")
    if not auth and (key := headers.get("x-api-key", "")):
        return f"Bearer {key}"
    return auth


def bearer_token(header: str) -> str | None:
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
