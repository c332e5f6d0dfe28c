"""Which model serves a request (``routed_json``: its ``model`` names it, for every dialect
and prompt route), held until the exchange's last byte.

A process started with one ``--model`` serves it whatever a request's ``model`` says, as it
always did; one serving several (``--model NAME=PATH``, ``--models-dir``) answers a name it
does not serve with a 404 (in the route's own shape: Anthropic's on /v1/messages), and a
request without ``model`` goes to the default model (the RPC model)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from ...serving import ModelBusy, ModelPool
from ...wire.errors import bad_param
from .common import (
    HttpError,
    app_state,
    check_turns,
    read_json_body,
    read_request_json,
    request_holds,
    require_engine,
)

if TYPE_CHECKING:
    from ...engine import Engine
    from ...serving import AppState


async def routed_json(*, token_ids: bool = False, pooled: bool = False) -> tuple[Engine, dict[str, Any]]:
    """A prompt route's JSON body and the engine of the model its ``model`` names (several
    models), held until the exchange's last byte: never unloaded under it. Loading or waking
    the model, and making room for it, is waited for up to --model-wait-s (then 503).
    ``pooled`` (embeddings, rerank): many inputs a request, so the body is capped by
    --max-json-bytes, not by what one slot's prompt can use, and its ``input`` is no turns."""
    state = app_state()
    engine = require_engine()  # 503 until the process is ready (the RPC model's engine is set last)
    pool = state.models
    strict = pool is not None and pool.strict
    if not strict and not pooled:  # one model: as always, whatever ``model`` says
        return engine, await read_request_json(token_ids=token_ids)
    # The body is read before its model is known: capped by --max-json-bytes alone.
    body = await read_json_body(state.settings.max_json_bytes)
    if pool is None or not pool.strict:
        return engine, body
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise bad_param("model must be a string", "model")
    engine = await hold_model(state, pool, name)
    if not token_ids and not pooled:
        check_turns(engine, body)
    return engine, body


async def hold_model(state: AppState, pool: ModelPool, name: str | None) -> Engine:
    """The engine of model ``name`` (None: the default one), held for the exchange."""
    entry = pool.find(name)
    if entry is None:
        # A LoRA adapter's name (--lora applies to the default model): that model serves it.
        default = state.engine
        if default is not None and name in default.adapters.names:
            return default
        raise HttpError(404, f"The model `{name}` does not exist.", "invalid_request_error", param="model")
    with trio.move_on_after(state.settings.model_wait_s) as waited:
        engine = await pool.acquire(entry)
        request_holds.get().callback(pool.release, entry)  # no checkpoint since the acquire
    if waited.cancelled_caught:
        raise ModelBusy(
            f"model {entry.name} is not ready after {state.settings.model_wait_s:g} s "
            f"({entry.state}; {pool.models_max} may hold memory at once: --models-max, --model-wait-s)"
        )
    return engine
