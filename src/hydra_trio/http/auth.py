"""API-key check for every HTTP route but /health (OpenAI / llama-server convention:
``Authorization: Bearer KEY``), and the startup warning for an exposed, keyless bind."""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import TYPE_CHECKING

from quart import Response, request

from ..config import is_loopback
from .common import json_response
from .sse import error_body

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from ..state import AppState

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without credentials


def install_auth(app: QuartTrio, state: AppState) -> None:
    key = state.settings.http_api_key()
    if key is None:
        if not is_loopback(state.settings.host):
            log.warning(
                "HTTP binds %s without an API key: anyone who reaches the port can use every "
                "route (set --api-key-file or HYDRA_API_KEY)",
                state.settings.host,
            )
        return
    # Compared as digests: compare_digest is constant-time for equal lengths, and digests
    # make the length of the key irrelevant too.
    expected = hashlib.sha256(key.encode()).digest()

    @app.before_request
    async def require_api_key() -> Response | None:
        if request.path in OPEN_PATHS:
            return None
        given = bearer_token(request.headers.get("Authorization", ""))
        if given is not None and hmac.compare_digest(hashlib.sha256(given.encode()).digest(), expected):
            return None
        state.metrics.http_auth_rejected.inc()
        message = "invalid API key" if given is not None else "missing API key: send 'Authorization: Bearer KEY'"
        return json_response(
            error_body(401, message, "authentication_error"), 401, {"WWW-Authenticate": "Bearer"}
        )


def bearer_token(header: str) -> str | None:
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
