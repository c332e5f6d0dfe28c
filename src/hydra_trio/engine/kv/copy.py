"""A slot's KV in and out as a v2 blob on the GPU worker: ``copy_out`` makes every copy
STATE_GET, PREFILL and a P/D export send, ``restore_blob`` puts every received one into a slot
(DECODE, STATE_SET, the P/D hand-off). The caller holds the slot (engine/lease.py), which
decides room and marks the slot as transferring while its bytes move."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import trio

from ...concurrency import run_cpu_bound
from ...wire.errors import ErrorCode, ProtocolError
from ...wire.hashing import Buffer, xxh3_tag_of
from ...wire.kvblob import KvBlob, blob_head_size, encode_blob_head
from ..llama import DecodeAborted, LlamaBackend, LoraSet
from ..worker import CallTiming, GpuWorker


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


async def copy_out(
    backend: LlamaBackend,
    worker: GpuWorker,
    slot: int,
    *,
    logits: bytes | None = None,
    reserve: Callable[[int], Awaitable[None]] | None = None,
) -> KvCopy:
    """The slot's KV as a v2 blob (head, state, and ``logits`` when given). ``reserve`` is
    awaited with the blob's exact size before anything is copied (the payload budget's
    charge)."""
    if reserve is not None:
        await reserve(blob_head_size(backend.n_past(slot)) + backend.slot_state_size(slot) + len(logits or b""))
    state, tokens = await worker.call(lambda: backend.state_get(slot))
    parts: list[Buffer] = [encode_blob_head(len(tokens), tokens), state]
    if logits is not None:
        parts.append(logits)
    return KvCopy(parts, len(tokens), len(state))


async def restore_blob(
    backend: LlamaBackend, worker: GpuWorker, slot: int, blob: KvBlob, timing: CallTiming | None, salt: str | None,
    lora: LoraSet = (),
) -> None:
    """Restore a parsed v2 blob into the slot, all-or-nothing (engine/llama/kv_state.py), as
    the history of ``salt`` and the LoRA adapter set ``lora``. Trailing logits become the slot's tail logits; a
    checkpoint section (``check_checkpoint`` passed it) becomes the slot's context checkpoint."""

    def call(abort: threading.Event) -> None:
        backend.state_restore(
            slot,
            blob.state,
            blob.tokens,
            blob.n_past,
            abort,
            blob=blob.raw,
            salt=salt,
            lora=lora,
            checkpoint=blob.checkpoint,
        )

    try:
        await worker.run(call, timing)
    except DecodeAborted:
        await trio.lowlevel.checkpoint()  # the cancellation that raised the flag
        raise

def check_checkpoint(blob: KvBlob, *, checkpoint_size: int | None) -> None:
    """A blob's checkpoint section (v2 flag 0x01; v3 flag 0x02: a recurrent-only capture):
    the recurrent state at ``n_tokens`` of the blob's positions, a roll-back point the slot
    keeps (engine/llama/checkpoints.py) so that a later prompt diverging after it resumes
    there. Refused where it does not apply (``checkpoint_size`` None: the model has no
    recurrent state); on a recurrent or hybrid model it must lie inside the blob's positions
    and be the size of this model's recurrent state (``LlamaBackend.checkpoint_size``, what
    ``llama_state_seq_get_data_ext`` with the partial flag writes). Its draft part is not
    read: this engine runs no draft model."""
    ck = blob.checkpoint
    assert ck is not None
    kind = "a recurrent-only capture (v3 flag 0x02)" if ck.recurrent_only else "a recurrent-state checkpoint"
    if checkpoint_size is None:
        raise ProtocolError(
            ErrorCode.BAD_FRAME,
            f"kv blob carries {kind}; the resident model has no recurrent state, so a checkpoint does not apply",
        )
    if not (0 <= ck.pos_min <= ck.pos_max < max(blob.n_past, 1)) or not 0 <= ck.n_tokens <= blob.n_past:
        raise ProtocolError(
            ErrorCode.BAD_FRAME,
            f"kv blob: {kind} for positions {ck.pos_min}..{ck.pos_max} ({ck.n_tokens} tokens) "
            f"outside the {blob.n_past} the blob holds",
        )
    if len(ck.data) != checkpoint_size:
        raise ProtocolError(
            ErrorCode.BAD_FRAME,
            f"kv blob: {kind} of {len(ck.data)} bytes; the resident model's recurrent state is {checkpoint_size}",
        )
