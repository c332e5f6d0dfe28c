"""``kv_transfer_params`` on the OpenAI routes: the hooks a completion route calls.

A route (chat completions; text completions use the same three calls) does:

    exported = await export_completion(state, body, engine, tokens, params, render)
    if exported is not None:
        return exported                        # prefill side: do_remote_decode
    handoff = begin_handoff(state, body, engine)  # decode side: None unless it names an export
    await fetch_handoff(state, handoff, tokens)  # the pull, before any slot is claimed
    async with engine.claim(...) as lease:
        await restore_handoff(handoff, lease)
        res = await lease.generate(tokens, params, emit)
    ... render(lease.id, res, **handoff_fields(handoff)) ...

``render(slot_id, result, **extra)`` builds the route's own non-streaming body.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import trio
from quart import Response

from ...engine import GenerationParams, LoraSet, SlotLease
from ...handoff.prefill import export_prefill, prefill_export
from ...handoff.restore import Handoff
from ...observability import generation_fields, request_extra
from ...wire.kvpull import export_params, wants_remote_decode
from ..generation import slot_for
from ..plumbing import (
    EngineStarting,
    client_request_id,
    json_response,
    request_nursery,
)

if TYPE_CHECKING:
    from ...engine import Engine
    from ...serving import AppState

Render = Callable[..., dict[str, Any]]
log = logging.getLogger(__name__)


async def export_completion(
    state: AppState, body: dict[str, Any], engine: Engine, tokens: list[int], params: GenerationParams, render: Render
) -> Response | None:
    """Prefill side: a request with ``kv_transfer_params.do_remote_decode`` true is prefilled,
    answered with the one token sampled after the prompt (what a P/D router asks for) and
    its KV is kept as an export named in the reply's ``kv_transfer_params``. None for any
    other request. The reply is JSON even if ``stream`` was asked (routers ask stream false)."""
    if not wants_remote_decode(body.get("kv_transfer_params")):
        return None
    exports = state.exports
    assert exports is not None, "the export store starts before HTTP serves requests"
    request_id = client_request_id() or secrets.token_hex(6)
    owner = f"http:kv-export:{request_id}"
    t_arrived = trio.current_time()
    async with slot_for(state, engine, tokens, owner, params) as lease:  # bounds the wait, not the prefill
        queue_s = trio.current_time() - t_arrived
        out = await prefill_export(lease, tokens, params)
    export = await export_prefill(engine, exports, out)
    state.metrics.record_generation("kv_export", out.result, model=engine.served_name, queue_s=queue_s)
    log.info(
        "kv_export %s slot %d: %d prompt (%d cached) in %.1f ms, %s",
        owner, out.slot_id, out.result.prompt_tokens, out.result.n_common, out.prefill_ms,
        f"export {export.id} "
        f"({export.nbytes} bytes)" if export is not None else "not exported (over --kv-export-max-bytes)",
        extra=request_extra(
            request_id=request_id, route="kv_export", model=engine.served_name, slot=out.slot_id,
            **generation_fields(out.result, outcome="done" if export is not None else "failed", queue_s=queue_s),
            error=None if export is not None else "export refused: over --kv-export-max-bytes", lora=params.lora_name,
        ),
    )
    extra: dict[str, Any] = {
        "kv_export": {
            "exported": export is not None,
            "prefill_ms": round(out.prefill_ms, 3),
            "copy_ms": round(out.copy_ms, 3),
            "slot_held_ms": round(out.slot_held_ms, 3),
        }
    }
    if export is not None:
        extra["kv_export"].update(export_id=export.id, kv_bytes=export.nbytes)
        extra["kv_transfer_params"] = export_params(
            host=state.settings.advertise_host or state.settings.host,
            port=_rpc_port(state),
            export_id=export.id,
            n_past=export.n_past,
            kv_hash=export.kv_hash,
            kv_bytes=export.nbytes,
            ttl_s=exports.ttl_s,
            identity=export.identity,
            shm=exports.shm.advertised() if export.shm is not None and exports.shm is not None else None,
        )
    return json_response(render(out.slot_id, out.result, **extra))


def _rpc_port(state: AppState) -> int:
    if state.rpc_port is None:  # the engine is up but the RPC listener not yet: still starting
        raise EngineStarting
    return state.rpc_port


async def begin_handoff(state: AppState, body: dict[str, Any], engine: Engine, lora: LoraSet = ()) -> Handoff | None:
    """Decode side: the hand-off the request's ``kv_transfer_params`` asks for (None when
    it names no hydra export), for a request under the LoRA adapter set ``lora``. Nothing
    moves yet: ``fetch_handoff`` pulls it."""
    raw = body.get("kv_transfer_params")
    if raw is None:
        return None
    exports = state.exports
    assert exports is not None
    return await Handoff.begin(engine, exports, raw, trace=client_request_id(), lora=lora)


async def fetch_handoff(state: AppState, handoff: Handoff | None, tokens: list[int]) -> None:
    """Pull and check the export before the request claims a slot (a dead or slow prefill
    engine holds no slot). What the pulled bytes hold of the payload budget goes back with
    the request, however it ends (its own nursery), or at the restore."""
    if handoff is None:
        return
    await handoff.fetch(state.settings, state.payload_budget, tokens)
    if handoff.holds_budget:
        request_nursery().start_soon(handoff.hold_until_released)


async def restore_handoff(handoff: Handoff | None, lease: SlotLease, salt: str | None = None) -> None:
    """Restore the fetched export into the claimed slot, with the logits for the first
    token, as the history of the request's cache ``salt`` and LoRA adapter set (nothing
    without a hand-off; a failed one falls back to a local prefill)."""
    if handoff is not None:
        await handoff.restore(lease, salt, let_go=_let_go_on_a_thread)


def _let_go_on_a_thread(holder: list[Any]) -> None:
    """The pulled blob's last reference dropped on a worker thread, in the request's own
    nursery (munmap releases the GIL): not between the restore and the first token."""
    request_nursery().start_soon(partial(trio.to_thread.run_sync, holder.clear, abandon_on_cancel=False))


def handoff_fields(handoff: Handoff | None) -> dict[str, Any]:
    """Extra response fields: ``kv_transfer`` says whether the KV came from the prefill
    engine or was recomputed here, and why."""
    return {} if handoff is None else {"kv_transfer": handoff.report()}


@dataclass(slots=True)
class DecodeSide:
    """The decode side of a completion route: the hand-off the request asks for (or none),
    the restore to run in the claimed slot (``prepare`` of http/generation/generation.py), and the
    response fields that report it."""

    handoff: Handoff | None
    restore: Callable[[SlotLease], Awaitable[None]]

    def fields(self) -> dict[str, Any]:
        return handoff_fields(self.handoff)


async def route(
    state: AppState, body: dict[str, Any], engine: Engine, tokens: list[int], params: GenerationParams, render: Render
) -> Response | DecodeSide:
    """Every completion route's entry: a prefill-side request is answered here (the
    Response); any other gets its decode side (a no-op one without kv_transfer_params)."""
    exported = await export_completion(state, body, engine, tokens, params, render)
    if exported is not None:
        return exported
    handoff = await begin_handoff(state, body, engine, params.lora)
    await fetch_handoff(state, handoff, tokens)
    return DecodeSide(handoff, partial(restore_handoff, handoff, salt=params.cache_salt))
