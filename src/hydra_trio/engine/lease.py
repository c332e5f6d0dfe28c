"""A claimed slot (``Engine.claim``): everything a caller does with one slot, for as long as
it holds it. The claim and the release are the ``async with`` around the lease, so no front
end writes a claim/release pair; a lease used after its block ends refuses (a bug, never a
silent write into a slot someone else may hold by then)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from ..wire.kvblob import KvBlob
from .kv import KvCopy
from .output import GenerationResult
from .params import GenerationParams
from .worker import CallTiming

if TYPE_CHECKING:
    from .core import EngineCore
    from .sched import Turn

Emit = Callable[[str], Awaitable[None]]


class SlotLease:
    """One slot, held by its claim's owner until the ``async with`` block ends."""

    __slots__ = ("_core", "_held", "_turn", "id", "touched")

    def __init__(self, core: EngineCore, slot_id: int, turn: Turn | None = None) -> None:
        self._core = core
        self.id = slot_id
        self._held = True
        self._turn = turn
        self.touched = False  # its KV changed: the history is the claim's session's now

    def _check(self) -> EngineCore:
        if not self._held:
            raise RuntimeError(f"slot {self.id}'s lease was used after its release")
        return self._core

    def _change(self) -> EngineCore:
        """For a call that changes the slot's KV."""
        core = self._check()
        self.touched = True
        return core

    def _end(self) -> None:
        self._held = False

    # ---- what the slot holds -------------------------------------------------------------

    @property
    def n_past(self) -> int:
        """Positions the slot's KV holds."""
        return self._core.n_past(self.id)

    def tokens(self) -> list[int]:
        """The tokens the slot's KV holds (a copy)."""
        return self._core.slot_tokens(self.id)

    @property
    def send_chunk(self) -> int | None:
        """The slot's STATE_GET send chunk (CONFIGURE T1 ``state_chunk_size``); None: whole."""
        return self._core.slot_settings.chunk_size(self.id)

    # ---- computing in it -------------------------------------------------------------------

    async def generate(
        self, tokens: Sequence[int], params: GenerationParams, emit: Emit, *, result: GenerationResult | None = None
    ) -> GenerationResult:
        """Prefill what the slot lacks of the prompt ``tokens``, then sample until a stop
        condition, ``emit`` receiving the text as it comes; ``result`` is filled in as it goes
        (read it even when cancelled), with what the slot holds when it ends (a receipt's)."""
        core = self._change()
        res = result if result is not None else GenerationResult()
        if self._turn is not None:
            res.session_id = self._turn.session_id
        try:
            return await core.generate(self.id, tokens, params, emit, result=res)
        finally:
            res.n_past_kept = core.n_past(self.id)

    async def prefill(self, tokens: Sequence[int], *, salt: str | None = None) -> bytes:
        """Evaluate the whole prompt into the emptied slot (RPC PREFILL) under ``salt``; the
        logits of its last position, which stay with the slot for a DECODE that follows."""
        core = self._change()
        await core.scheduler.adopt_salt(self.id, salt)
        _, logits = await core.prefill(self.id, tokens, 0, want_logits=True)
        assert logits is not None, "asked for"
        return logits

    async def sample_first(self, tokens: Sequence[int], params: GenerationParams) -> tuple[GenerationResult, bytes]:
        """A P/D prefill: the prompt in the slot (prefix reuse as generation) and the one token
        it answers with, by generation's own stop rules; with the logits it came from."""
        return await self._change().sample_first(self.id, tokens, params)

    # ---- its KV --------------------------------------------------------------------------

    async def copy_out(
        self, *, logits: bytes | None = None, reserve: Callable[[int], Awaitable[None]] | None = None
    ) -> KvCopy:
        """The slot's KV as a v2 blob (and ``logits``); ``reserve`` is awaited with its exact
        size before any byte is copied."""
        return await self._check().copy_out(self.id, logits=logits, reserve=reserve)

    async def restore(self, blob: KvBlob, *, timing: CallTiming | None = None, salt: str | None = None) -> None:
        """An admitted blob into the slot, all-or-nothing, as ``salt``'s history."""
        await self._change().restore(self.id, blob, timing, salt=salt)

    async def clear(self) -> int:
        """Empty the slot's KV; the positions it held."""
        core = self._change()
        n = core.n_past(self.id)
        await core.clear_slot(self.id)
        return n
