"""``POST /finish_session``: an agent session is over (vllm-router's endpoint and shape:
``?session_id=ID``, or a small JSON body ``{"session_id": ID}``; ``cache_salt`` the same
ways). Its tree's live requests are cancelled (each answers with its receipt), its KV is
released in every tier, its records forgotten. Scoped by the caller's tenant (its API key)
and ``cache_salt``: naming another tenant's session finds nothing, as an unknown id does,
and takes the same path. Idempotent: 200 either way, ``found`` says which. A process serving
several models finishes the session in each model loaded now (a session lives in the engine
that served its turns), or in the one ``model`` names."""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, request

from ...engine import Engine, Finished
from ...engine import cache_salt as checked_salt
from ...wire.agentic import checked_id
from ...wire.errors import bad_param
from ..plumbing import (
    app_state,
    hold_model,
    json_response,
    read_json_body,
    request_tenant,
    require_engine,
    routes,
)

bp = Blueprint("sessions", __name__)


@bp.post("/finish_session")
async def finish_session() -> Response:
    engine = require_engine()
    body: dict[str, Any] = {}
    if request.content_length or "chunked" in request.headers.get("Transfer-Encoding", "").lower():
        body = await read_json_body(routes.SMALL_BODY_BYTES, "the finish_session route's cap")
    fields = {**body, **{k: request.args[k] for k in ("session_id", "cache_salt", "model") if k in request.args}}
    if fields.get("session_id") is None:
        raise bad_param('session_id is required (?session_id=ID, or a JSON body {"session_id": ID})', "session_id")
    session_id = checked_id(fields["session_id"], "session_id")
    salt = checked_salt(fields)
    done = Finished(found=False)
    for one in await _engines(engine, fields.get("model")):
        part = await one.sessions(request_tenant()).finish(session_id, salt)
        done = Finished(
            done.found or part.found,
            done.sessions + part.sessions,
            done.cancelled + part.cancelled,
            done.slots_cleared + part.slots_cleared,
            done.ram_entries + part.ram_entries,
            done.disk_entries + part.disk_entries,
        )
    return json_response(
        {
            "session_id": session_id,
            "found": done.found,
            "sessions": done.sessions,
            "cancelled_requests": done.cancelled,
            "released": {"slots": done.slots_cleared, "ram_entries": done.ram_entries,
                         "disk_entries": done.disk_entries},
        }
    )



async def _engines(default: Engine, model: Any) -> list[Engine]:
    """The engines whose sessions a finish reaches: the one model serving (one model), the
    one ``model`` names, else every model loaded now."""
    state = app_state()
    pool = state.models
    if pool is None or not pool.strict:
        return [default]
    if model is not None:
        if not isinstance(model, str):
            raise bad_param("model must be a string", "model")
        return [await hold_model(state, pool, model)]
    engines: list[Engine] = []
    for _, engine in pool.loaded():
        if all(engine is not e for e in engines):
            engines.append(engine)
    return engines
