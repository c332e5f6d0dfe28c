"""The routes that list, load and unload models: ``GET /v1/models`` and llama-server's
router routes ``GET /models``, ``POST /models/load``, ``POST /models/unload`` (which model
serves a request is http/plumbing/model_choice.py's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio
from quart import Blueprint, Response

from ...serving import ModelBusy, ModelEntry, ModelError, ModelLoadFailed, ModelPool, ModelRefused
from ...wire.errors import bad_param
from ..plumbing import (
    SMALL_BODY_BYTES,
    HttpError,
    app_state,
    busy_reply,
    error_body,
    json_response,
    read_json_body,
    require_engine,
)

if TYPE_CHECKING:
    from ...engine import Engine
    from ...serving import AppState

bp = Blueprint("models", __name__)


# ---- listing -------------------------------------------------------------------------------


def _entry_view(state: AppState, entry: ModelEntry) -> dict[str, Any]:
    """One model as llama-server's router lists it (``status.value``: loaded, loading,
    unloaded or sleeping), with what it cost and, loaded, what /v1/models says of one model."""
    status: dict[str, Any] = {"value": str(entry.state), "args": []}
    if entry.failure is not None:
        status.update(failed=True, error=str(entry.failure))
    view: dict[str, Any] = {
        "id": entry.name,
        "aliases": [],
        "tags": [],
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "hydra-trio",
        "status": status,
        "source": entry.source,
        "path": entry.path,
        "pinned": entry.pinned,
        "rpc": entry.name == (state.models.default_name if state.models else None),
        "requests": entry.users,
        "waiting": entry.waiting,
        "loads": entry.loads,
        "wakes": entry.wakes,
        "sleeps": entry.sleeps,
        "evictions": entry.evictions,
        "last_load_ms": None if entry.last_load_s is None else round(entry.last_load_s * 1000.0, 3),
        "last_wake_ms": None if entry.last_wake_s is None else round(entry.last_wake_s * 1000.0, 3),
    }
    if entry.engine is not None:
        view["meta"] = _meta(entry.engine)
    return view


def _meta(engine: Engine) -> dict[str, Any]:
    identity = engine.identity
    return {**identity.info_fields(), "n_ctx": engine.n_ctx, "n_vocab": engine.n_vocab}


@bp.get("/v1/models")
@bp.get("/models")
async def models() -> Response:
    state = app_state()
    pool = state.models
    if pool is not None and pool.strict:
        return json_response({"object": "list", "data": [_entry_view(state, e) for e in pool.entries()]})
    engine = require_engine()  # one model: OpenAI's list of it, as always
    ident = engine.identity
    created = int(state.started_at)
    base = {
        "id": ident.model_alias, "object": "model", "created": created, "owned_by": "hydra-trio",
        "root": ident.model_alias, "parent": None, "meta": _meta(engine),
    }
    # Each LoRA adapter as a model of its own, as vLLM lists them: its name selects it.
    adapters = engine.adapters
    loras = [
        {
            "id": a["name"],
            "object": "model",
            "created": created,
            "owned_by": "hydra-trio",
            "root": a["path"],
            "parent": ident.model_alias,
        }
        for a in adapters.listing()
    ]
    return json_response({"object": "list", "data": [base, *loras]})


# ---- loading and unloading --------------------------------------------------------------------


async def _named_entry(not_found: int) -> tuple[ModelPool, ModelEntry]:
    """The model a /models/load or /models/unload body names (``{"model": NAME}``); unknown:
    ``not_found`` (llama-server answers 404 to a load, 400 to an unload)."""
    state = app_state()
    require_engine()  # 503 while starting
    pool = state.models
    assert pool is not None, "set with the engine"
    name = (await read_json_body(SMALL_BODY_BYTES)).get("model")
    if not isinstance(name, str) or not name:
        raise bad_param("model must be a non-empty string", "model")
    entry = pool.find(name) if pool.strict else pool.find(None)
    if entry is None:
        raise HttpError(
            not_found, "model is not found", "not_found_error" if not_found == 404 else "invalid_request_error"
        )
    return pool, entry


@bp.post("/models/load")
async def load_model() -> Response:
    """Load (or wake) the model now; answers once it serves, or 503 after --model-wait-s."""
    pool, entry = await _named_entry(404)
    settings = app_state().settings
    with trio.move_on_after(settings.model_wait_s) as waited:
        await pool.load(entry)
    if waited.cancelled_caught:
        raise ModelBusy(f"model {entry.name} is not loaded after {settings.model_wait_s:g} s (--model-wait-s); it goes "
                        "on loading")
    return json_response({"success": True})


@bp.post("/models/unload")
async def unload_model() -> Response:
    """Free the model now; refused (503, retry) while requests hold it, 400 when it is not
    running or pinned."""
    pool, entry = await _named_entry(400)
    await pool.unload(entry)
    return json_response({"success": True})


@bp.app_errorhandler(ModelError)
async def _model_error(err: ModelError) -> Response:
    if isinstance(err, ModelBusy):
        return busy_reply(err.message)
    if isinstance(err, ModelLoadFailed):
        return json_response(error_body(500, err.message, "server_error"), 500)
    assert isinstance(err, ModelRefused)
    return json_response(error_body(400, err.message, "invalid_request_error"), 400)
