"""llama-server's slot routes: ``GET /slots`` (every slot: its request, its owner, what it
holds; other clients' request ids, so the admin's) and ``POST /slots/{id}?action=erase``; a
slot's state is http/slots/state_routes.py's."""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, request

from ...engine import SlotInfo
from ...serving import slot_state
from ...wire.protocol import ascii_decimal
from ..plumbing import HttpError, json_response, read_json_body, require_engine, routes

bp = Blueprint("slots", __name__)


@bp.get("/slots")
async def slots() -> Response:
    engine = require_engine()
    return json_response([slot_view(engine.slot_info(i)) for i in range(engine.stats().slots)])


def slot_view(info: SlotInfo) -> dict[str, Any]:
    """A slot in llama-server's /slots names (the description is ``Engine.slot_info``)."""
    return {
        "id": info.id,
        "id_slot": info.id,
        **info.fields(),
        "owner": info.owner,
        "n_ctx": info.n_ctx,  # what this slot can hold (llama-server's meaning)
    }


def slot_id_of(raw: str) -> int:
    slot = ascii_decimal(raw)
    if slot is None:
        raise HttpError(400, "slot id must be a non-negative integer in ASCII digits, got "
                        f"{raw[:40]!r}", "invalid_request_error")
    return slot


@bp.post("/slots/<raw_id>")
async def slot_action(raw_id: str) -> Response:
    engine = require_engine()
    slot_id = slot_id_of(raw_id)
    action = request.args.get("action", "")
    if action != "erase":
        raise HttpError(400, f"unsupported action {action!r} (supported: erase)", "invalid_request_error")
    if request.content_length or "chunked" in request.headers.get("Transfer-Encoding", "").lower():
        # llama-server's slot API takes a JSON body here ({}); a small object, ignored.
        await read_json_body(routes.SMALL_BODY_BYTES, "the erase route's cap")
    return json_response(await slot_state.erase(engine, slot_id, f"http:erase:{slot_id}"))
