"""The engine's status: ``GET /health`` (what load balancers probe, without credentials; also
the answer past --max-http-connections), ``GET /version`` (the build, the hardware, the
template) and ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quart import Blueprint, Response

from ..plumbing import RETRY_AFTER, app_state, json_response

if TYPE_CHECKING:
    from ...serving import AppState

bp = Blueprint("status", __name__)


@bp.get("/health")
async def health() -> Response:
    status, body, headers = health_reply(app_state())
    return json_response(body, status, headers=headers)


def health_reply(state: AppState) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) of /health; also what a connection past
    --max-http-connections is answered (http/plumbing/connections.py)."""
    engine = state.engine
    if engine is None:
        return 503, {"status": "starting", "detail": state.startup_phase}, {}
    if state.draining:  # load balancers take the engine out; running requests finish
        return 503, {"status": "draining", "in_flight": state.in_flight()}, RETRY_AFTER
    stats, identity = engine.stats(), engine.identity
    return (
        200,
        {
            "status": "ok",
            "model": engine.served_name,
            "model_name": identity.model_name,
            "slots_idle": stats.slots_idle,
            "slots_processing": stats.slots_busy,
        },
        {},
    )


@bp.get("/version")
async def version() -> Response:
    from ... import __version__

    state = app_state()
    body: dict[str, Any] = {"engine": "hydra-trio", "version": __version__, "llama_cpp_python": state.llama_cpp_version}
    if state.engine is not None:  # hardware and template are known once the model is loaded
        body.update(state.engine.runtime_fields())
    if state.kv_events is not None:
        body["kv_events"] = state.kv_events.describe()
    return json_response(body)


@bp.get("/metrics")
async def metrics() -> Response:
    return Response(app_state().metrics.render(), status=200, content_type="text/plain; version=0.0.4")
