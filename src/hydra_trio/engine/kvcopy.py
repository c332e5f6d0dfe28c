"""A slot's KV in and out as a v2 blob: ``SlotKv.copy_out`` makes every copy STATE_GET,
PREFILL and a P/D export send, ``SlotKv.restore`` puts every received one into a slot
(DECODE, STATE_SET, the P/D hand-off)."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import trio

from ..tasks import run_cpu_bound
from ..wire.errors import ErrorCode, ProtocolError
from ..wire.hashing import Buffer, xxh3_tag_of
from ..wire.kvblob import KvBlob, blob_head_size, encode_blob_head
from .inputs import Inputs
from .llama.context import LlamaBackend
from .llama.state import DecodeAborted
from .scheduler import SlotScheduler
from .slots import SlotTable
from .worker import CallTiming, GpuWorker


@dataclass(slots=True)
class KvCopy:
    parts: list[Buffer]  # head, llama state (, the last position's logits)
    n_past: int
    state_size: int  # llama state bytes

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.parts)

    async def kv_hash(self) -> str:
        """The blob's tag, hashed off the trio thread when it is large."""
        return await run_cpu_bound(partial(xxh3_tag_of, self.parts), self.size)


class SlotKv:
    """Copies of a slot's KV, out and in, on the engine's GPU worker. A slot shows as
    transferring while its bytes move (slot_info, the byte budget's readers)."""

    def __init__(
        self,
        backend: Callable[[], LlamaBackend],
        worker: GpuWorker,
        slots: SlotTable,
        scheduler: SlotScheduler,
        inputs: Inputs,
    ) -> None:
        self._backend = backend  # looked up per call: CONFIGURE T3 replaces it
        self._worker = worker
        self._slots = slots
        self._scheduler = scheduler
        self._inputs = inputs

    async def copy_out(
        self,
        slot_id: int,
        *,
        logits: bytes | None = None,
        reserve: Callable[[int], Awaitable[None]] | None = None,
    ) -> KvCopy:
        """The slot's KV as a v2 blob (head, state, and ``logits`` when given). The caller
        holds the slot. ``reserve`` is awaited with the blob's exact size before anything is
        copied (the payload budget's charge)."""
        backend = self._backend()
        slot = self._slots.get(slot_id)
        slot.transferring = True
        try:
            if reserve is not None:
                n_past = backend.n_past(slot_id)
                await reserve(
                    blob_head_size(n_past) + backend.slot_state_size(slot_id) + len(logits or b"")
                )
            state, tokens = await self._worker.call(lambda: backend.state_get(slot_id))
        finally:
            slot.transferring = False
        parts: list[Buffer] = [encode_blob_head(len(tokens), tokens), state]
        if logits is not None:
            parts.append(logits)
        return KvCopy(parts, len(tokens), len(state))

    async def restore(
        self, slot: int, blob: KvBlob, timing: CallTiming | None = None, *, salt: str | None = None
    ) -> None:
        """Restore a parsed v2 blob into the slot, all-or-nothing, as ``salt``'s history (the
        cache_salt of the request it serves; None: unsalted). Trailing logits become the
        slot's tail logits (``reuse_plan``)."""
        backend = self._backend()
        if blob.checkpoint is not None and not backend.info.recurrent:
            raise ProtocolError(
                ErrorCode.BAD_FRAME,
                "kv blob carries a recurrent-state checkpoint; the resident model is not recurrent",
            )
        if blob.n_past >= backend.n_ctx_slot:
            raise ProtocolError(
                ErrorCode.RESTORE_FAILED,
                f"blob holds {blob.n_past} positions; {self._inputs.slot_room()}",
            )
        await self._scheduler.make_room(blob.n_past, exclude=slot)

        def call(abort: threading.Event) -> None:
            backend.state_restore(
                slot, blob.state, blob.tokens, blob.n_past, abort, blob=blob.raw, salt=salt
            )

        held = self._slots.get(slot)
        held.transferring = True
        try:
            await self._worker.run(call, timing)
        except DecodeAborted:
            await trio.lowlevel.checkpoint()  # the cancellation that raised the flag
            raise
        finally:
            held.transferring = False
