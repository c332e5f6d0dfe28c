"""One way for HTTP routes to run a generation: claim a slot, call ``Engine.generate`` (the
entry point every path shares, so requests join the same continuous batches), release.

Chat completions and text completions differ only in how they shape the result; both use
``generate_buffered`` or ``start_stream`` from here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio
from quart import Response

from ..engine.engine import GenerationResult
from ..engine.params import GenerationParams
from ..tasks import start_owned
from ..wire.errors import ProtocolError
from .common import json_response
from .sse import error_body

if TYPE_CHECKING:
    from ..app import AppState
    from ..engine.engine import Engine
    from ..tasks import OwnedTask

log = logging.getLogger(__name__)


class SlotsBusy(Exception):
    """No slot became free within --slot-wait-s."""


def all_slots_busy(state: AppState) -> Response:
    return json_response(
        error_body(
            503,
            f"all slots are busy (waited {state.settings.slot_wait_s:g} s)",
            "unavailable_error",
        ),
        503,
        headers={"Retry-After": "1"},
    )


async def _discard(_delta: str) -> None:
    return None


async def generate_buffered(
    state: AppState,
    engine: Engine,
    tokens: Sequence[int],
    params: GenerationParams,
    *,
    owner: str,
    path: str,
) -> tuple[int, GenerationResult]:
    """(slot id, result) of a whole generation. Raises SlotsBusy."""
    try:
        slot = await engine.claim_for_prompt(tokens, owner, state.settings.slot_wait_s)
    except trio.TooSlowError:
        raise SlotsBusy from None
    try:
        res = await engine.generate(slot.id, tokens, params, _discard)
    finally:
        engine.release(slot)
    state.record_generation(path, res)
    return slot.id, res


@dataclass(slots=True)
class GenerationStream:
    """A generation running in the request nursery; ``items`` receives ("delta", text), then
    ("done", GenerationResult) or ("error", exception). The reader must ``close()`` it."""

    task: OwnedTask
    slot_id: int
    items: trio.MemoryReceiveChannel[tuple[str, Any]]

    async def close(self) -> None:
        """Stop generation (client gone or stream over) and wait until it has stopped."""
        with trio.CancelScope(shield=True):
            await self.items.aclose()
            await self.task.cancel_and_wait()


async def start_stream(
    state: AppState,
    engine: Engine,
    tokens: Sequence[int],
    params: GenerationParams,
    *,
    owner: str,
    path: str,
) -> GenerationStream:
    """Claim a slot and start generating into a channel. Raises SlotsBusy."""
    send, recv = trio.open_memory_channel[tuple[str, Any]](64)
    stall_s = state.settings.slot_wait_s

    async def produce(task_status: Any) -> None:
        try:
            slot = await engine.claim_for_prompt(tokens, owner, state.settings.slot_wait_s)
        except trio.TooSlowError:
            raise SlotsBusy from None
        task_status.started(slot.id)

        async def put(item: tuple[str, Any]) -> None:
            # A reader that stops reading without disconnecting must not hold the slot forever.
            with trio.fail_after(stall_s):
                await send.send(item)

        async def emit(delta: str) -> None:
            await put(("delta", delta))

        async with send:
            try:
                res = await engine.generate(slot.id, tokens, params, emit)
                state.record_generation(path, res)
                await put(("done", res))
            except (ProtocolError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                log.info("streaming generation %s ended early: %r", owner, exc)
                with trio.move_on_after(0):
                    await send.send(("error", exc))
            finally:
                engine.release(slot)

    task, slot_id = await start_owned(state.nursery, owner, produce)
    return GenerationStream(task, slot_id, recv)
