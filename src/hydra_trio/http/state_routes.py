"""Slot state over HTTP (spec §6.5): meta, GET/PUT of the v2 blob, erase."""

from __future__ import annotations

from quart import Blueprint, Response, request

from ..engine import transfer
from .common import HttpError, app_state, json_response, require_engine

bp = Blueprint("slot_state", __name__)


def _slot_id(raw: str) -> int:
    if not raw.isdigit() or len(raw) > 9:
        raise HttpError(400, f"slot id must be a non-negative integer, got {raw[:40]!r}", "invalid_request_error")
    return int(raw)


@bp.get("/slots/<raw_id>/state/meta")
async def state_meta(raw_id: str) -> Response:
    return json_response(transfer.slot_meta(require_engine(), _slot_id(raw_id)))


@bp.get("/slots/<raw_id>/state")
async def state_get(raw_id: str) -> Response:
    engine = require_engine()
    slot_id = _slot_id(raw_id)
    snap = await transfer.snapshot(engine, slot_id, f"http:state_get:{slot_id}")
    body = b"".join(snap.parts)
    return Response(
        body,
        status=200,
        content_type="application/octet-stream",
        headers={
            "X-Hydra-State-Size": str(snap.state_size),
            "X-Hydra-N-Past": str(snap.n_past),
            "X-Hydra-KV-Hash": snap.kv_hash,
        },
    )


@bp.put("/slots/<raw_id>/state")
async def state_put(raw_id: str) -> Response:
    engine = require_engine()
    slot_id = _slot_id(raw_id)
    engine.slots.get(slot_id)
    limit = app_state().settings.max_kv_bytes
    length = request.content_length
    if length is not None and length > limit:
        raise HttpError(413, f"blob of {length} bytes exceeds the cap of {limit}", "invalid_request_error")
    data = bytearray(await request.get_data(cache=False, as_text=False))
    meta = await transfer.restore(engine, slot_id, memoryview(data), f"http:state_put:{slot_id}")
    app_state().metrics.restore_bytes.inc(len(data))
    return json_response(meta, headers={"X-Hydra-N-Past": str(meta["n_past"])})


@bp.post("/slots/<raw_id>")
async def slot_action(raw_id: str) -> Response:
    engine = require_engine()
    slot_id = _slot_id(raw_id)
    action = request.args.get("action", "")
    if action != "erase":
        raise HttpError(400, f"unsupported action {action!r} (supported: erase)", "invalid_request_error")
    return json_response(await transfer.erase(engine, slot_id, f"http:erase:{slot_id}"))
