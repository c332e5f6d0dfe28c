"""What every HTTP route stands on, whatever its API: the one table of route facts
(``routes``), who may call which (``auth``), bounded connections and direct chunk writes
(``connections``), request bodies, admission and the error mapping (``common``), the SSE
framing and the one error shape (``sse``), a request's agent session (``session_hints``) and
the model that serves it (``model_choice``).
Nothing here knows a dialect."""

from . import connections, routes
from .auth import OPEN_TENANT, KeyRing, access, install_auth, request_tenant
from .common import (
    SLOTLESS_AT_ONCE,
    EngineStarting,
    HttpError,
    app_state,
    busy_reply,
    check_turns,
    client_request_id,
    drain_body,
    generation_owner,
    http_status,
    json_response,
    needs_no_slot,
    off_loop,
    read_json_body,
    read_request_json,
    receive_body,
    register_error_handlers,
    request_holds,
    request_nursery,
    require_engine,
    set_request_nursery,
)
from .connections import ChunkWriter, chunk_writer, close_connection_after
from .model_choice import hold_model, routed_json
from .routes import SMALL_BODY_BYTES, Role, role_of
from .session_hints import RequestSession, request_session
from .sse import (
    HOLE,
    RETRY_AFTER,
    SSE_DONE,
    busy_body,
    error_body,
    named_event,
    sse_event,
    sse_text_events,
    wants_sse,
)

__all__ = [
    "HOLE", "OPEN_TENANT", "RETRY_AFTER", "SLOTLESS_AT_ONCE", "SMALL_BODY_BYTES", "SSE_DONE", "ChunkWriter",
    "EngineStarting", "HttpError", "KeyRing", "RequestSession", "Role", "access", "app_state", "busy_body",
    "busy_reply",
    "check_turns", "chunk_writer", "client_request_id", "close_connection_after", "connections",
    "drain_body", "error_body", "generation_owner", "hold_model", "http_status", "install_auth", "json_response",
    "named_event", "needs_no_slot",
    "off_loop", "read_json_body", "read_request_json", "receive_body", "register_error_handlers",
    "request_holds", "request_nursery", "request_session", "request_tenant", "require_engine", "role_of", "routed_json",
    "routes",
    "set_request_nursery", "sse_event", "sse_text_events", "wants_sse",
]
