"""A request's agent session, read at the edge: its tenant (the API key it came with,
http/plumbing/auth.py) and what its headers and body say of its session (wire/agentic.py), the one
small value the routes hand down to a generation (http/generation/generation.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from quart import request

from ...wire.agentic import SessionHint, session_hint
from .auth import request_tenant


@dataclass(frozen=True, slots=True)
class RequestSession:
    tenant: str
    hint: SessionHint | None  # None: a one-off request


def request_session(body: Mapping[str, Any]) -> RequestSession:
    """The session of the HTTP request being handled (a malformed hint: 400 naming it)."""
    return RequestSession(request_tenant(), session_hint(request.headers.get, body))
