"""llama-server's LoRA adapter routes: ``GET /lora-adapters`` lists the adapters loaded with
the model (``--lora``) with their default scales, ``POST /lora-adapters`` sets those scales
(an adapter left out gets 0, as llama-server does). The defaults are what a request without
its own ``lora`` list runs under; what runs keeps the set it started with."""

from __future__ import annotations

import logging

from quart import Blueprint, Response

from ..plumbing import app_state, json_response, read_json_body, require_engine

log = logging.getLogger(__name__)
bp = Blueprint("lora", __name__)


@bp.get("/lora-adapters")
async def list_adapters() -> Response:
    adapters = require_engine().adapters
    return json_response(adapters.listing())


@bp.post("/lora-adapters")
async def set_adapters() -> Response:
    adapters = require_engine().adapters
    body = await read_json_body(app_state().settings.max_json_bytes, any_value=True)
    adapters.set_scales(body)  # a 400 naming the entry at fault; nothing changes then
    log.info(
        "LoRA adapters' default scales set: %s",
        ", ".join(f"{a['name']} {a['scale']:g}" for a in adapters.listing()) or "none loaded",
    )
    return json_response({"success": True})
