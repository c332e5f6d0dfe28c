"""The slot-state use cases the RPC ops (STATE_GET/PUT/META, erase) and the HTTP state
routes share, over the engine's face: a snapshot charged to the payload budget, a restore of
an admitted blob, a slot's description, an erase."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..concurrency import ByteBudget
from ..engine import Engine
from ..wire.hashing import Buffer


@dataclass(slots=True)
class Snapshot:
    parts: list[Buffer]  # the v2 blob: head, llama state (, logits)
    n_past: int
    state_size: int  # llama state bytes
    kv_hash: str
    ms: float
    send_chunk: int | None = None  # the slot's STATE_GET send chunk (CONFIGURE T1); None: whole
    held: int = 0  # payload-budget bytes charged for it: the sender releases them once sent
    made_under: dict[str, Any] | None = None  # the LoRA adapter set (``SlotLease.kv_claims``)

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.parts)


async def snapshot(engine: Engine, slot_id: int, owner: str, budget: ByteBudget, wait_s: float) -> Snapshot:
    """Copy a slot's KV out as a v2 blob, charged to the payload budget until the caller has
    sent it (``held``). The slot is held only for the copy."""
    t0 = time.perf_counter()
    held = 0

    async def reserve(size: int) -> None:
        nonlocal held
        await budget.take(size, within_s=wait_s, what="a KV snapshot")
        held = size

    try:
        async with engine.claim(owner, slot=slot_id) as lease:
            copy = await lease.copy_out(reserve=reserve)
            chunk, made_under = lease.send_chunk, lease.kv_claims()
        kv_hash = await copy.kv_hash()
    except BaseException:
        budget.release(held)
        raise
    return Snapshot(
        copy.parts, copy.n_past, copy.state_size, kv_hash, (time.perf_counter() - t0) * 1000.0, chunk, held, made_under
    )


async def restore(engine: Engine, slot_id: int, blob: memoryview, owner: str) -> dict[str, Any]:
    """Check a v2 blob's structure, then restore it into the slot, all-or-nothing."""
    admitted = await engine.admit(blob)  # BAD_FRAME before the slot is touched
    assert admitted.blob is not None, "bytes were given"
    t0 = time.perf_counter()
    async with engine.claim(owner, slot=slot_id) as lease:
        await lease.restore(admitted.blob)
        n_past = lease.n_past
    return {
        "restored": True,
        "bytes": len(blob),
        "n_past": n_past,
        "restore_ms": round((time.perf_counter() - t0) * 1000.0, 3),
        # What was really checked: llama.cpp accepted the layout for the resident model.
        "model_match": True,
        **engine.identity.fields(),
    }


def slot_meta(engine: Engine, slot_id: int) -> dict[str, Any]:
    """STATE_META's reply: the slot's description (``Engine.slot_info``) and the model's."""
    return {"slot_id": slot_id, **engine.slot_info(slot_id).fields(), **engine.identity.fields()}


async def erase(engine: Engine, slot_id: int, owner: str) -> dict[str, Any]:
    async with engine.claim(owner, slot=slot_id) as lease:
        n_before = await lease.clear()
    return {"id_slot": slot_id, "n_erased": n_before}
