"""Slot state transfer shared by the RPC ops and the HTTP state routes."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from ..budget import ByteBudget
from ..tasks import run_cpu_bound
from ..wire.errors import ErrorCode, ProtocolError
from ..wire.kvblob import parse_kv_blob
from .engine import Engine
from .kvcopy import Buffer


@dataclass(slots=True)
class Snapshot:
    parts: list[Buffer]  # the v2 blob: head, llama state (, logits)
    n_past: int
    state_size: int  # llama state bytes
    kv_hash: str
    ms: float
    held: int = 0  # payload-budget bytes charged for it: the sender releases them once sent

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.parts)


async def charge(budget: ByteBudget, n: int, wait_s: float, what: str) -> None:
    """Take ``n`` bytes of the payload budget for a copy about to be made, waiting up to
    ``wait_s`` for room (BUSY otherwise): snapshots held for slow readers count too."""
    with trio.move_on_after(wait_s) as wait:
        await budget.acquire(n)
    if wait.cancelled_caught:
        raise ProtocolError(
            ErrorCode.SLOT_BUSY, f"no room in --max-inflight-bytes for {what} of {n} bytes within {wait_s:g} s"
        )


async def snapshot(engine: Engine, slot_id: int, owner: str, budget: ByteBudget, wait_s: float) -> Snapshot:
    """Copy a slot's KV out as a v2 blob, charged to the payload budget until the caller has
    sent it (``held``). The slot is held only for the copy."""
    t0 = time.perf_counter()
    slot = engine.slot_claim(slot_id, owner)
    held = 0

    async def reserve(size: int) -> None:
        nonlocal held
        await charge(budget, size, wait_s, "a KV snapshot")
        held = size

    try:
        try:
            copy = await engine.kv.copy_out(slot_id, reserve=reserve)
        finally:
            engine.release(slot)
        kv_hash = await copy.kv_hash()
    except BaseException:
        budget.release(held)
        raise
    return Snapshot(copy.parts, copy.n_past, copy.state_size, kv_hash, (time.perf_counter() - t0) * 1000.0, held)


async def restore(engine: Engine, slot_id: int, blob: memoryview, owner: str) -> dict[str, Any]:
    """Check a v2 blob's structure, then restore it into the slot, all-or-nothing."""
    parsed = await run_cpu_bound(  # BAD_FRAME before the slot is touched
        partial(parse_kv_blob, blob, max_tokens=engine.n_ctx_slot), len(blob)
    )
    t0 = time.perf_counter()
    slot = engine.slot_claim(slot_id, owner)
    try:
        await engine.kv.restore(slot_id, parsed)
    finally:
        engine.release(slot)
    return {
        "restored": True,
        "bytes": len(blob),
        "n_past": engine.n_past(slot_id),
        "restore_ms": round((time.perf_counter() - t0) * 1000.0, 3),
        # What was really checked: llama.cpp accepted the layout for the resident model.
        "model_match": True,
        **engine.identity.fields(),
    }


def slot_meta(engine: Engine, slot_id: int) -> dict[str, Any]:
    """STATE_META's reply: the slot's description (``Engine.slot_info``) and the model's."""
    return {"slot_id": slot_id, **engine.slot_info(slot_id).fields(), **engine.identity.fields()}


async def erase(engine: Engine, slot_id: int, owner: str) -> dict[str, Any]:
    slot = engine.slot_claim(slot_id, owner)
    try:
        n_before = engine.n_past(slot_id)
        await engine.clear_slot(slot_id)
    finally:
        engine.release(slot)
    return {"id_slot": slot_id, "n_erased": n_before}

