"""A claimed slot (``Engine.claim``): everything a caller does with one slot, for as long as
it holds it. The claim and the release are the ``async with`` around the lease, so no front
end writes a claim/release pair; a lease used after its block ends refuses (a bug, never a
silent write into a slot someone else may hold by then).

Scoring a prompt (``score``, ``score_prompt`` below: text completions' ``echo`` with
``logprobs``, what lm-eval's loglikelihood tasks read) evaluates the prompt anew into the
slot with every position's logits, each token's log-probability (and top alternatives) given
the tokens before it: a position reused from cache has no logits to read, so the slot's
history goes to the prompt cache first. Its last position's logits stay with the slot, so a
generation that follows samples its first token from them, as a restored hand-off does
(``SlotScheduler.reuse_plan``): the echoed prompt and the completion are one computation.
The parts are cancellable worker calls, as a prefill's chunks: --batch-size tokens, or
--step-token-budget while streams generate (between two parts every waiting step runs). The
log-softmax of each row is taken in the call (the next decode overwrites the logits), row by
row: a part's rows are never copied out whole."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from ..wire.errors import ErrorCode, ProtocolError
from ..wire.kvblob import KvBlob
from .kv import KvCopy, check_checkpoint, copy_out, restore_blob
from .llama import DecodeAborted, LoraSet, NoKvSpace
from .output import GenerationResult
from .params import GenerationParams
from .sample import TokenLogprobs, token_logprobs
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

    async def prefill(self, tokens: Sequence[int], *, salt: str | None = None, lora: LoraSet = ()) -> bytes:
        """Evaluate the whole prompt into the emptied slot (RPC PREFILL) under ``salt`` and the
        adapter set ``lora``; the logits of its last position, which stay with the slot for a
        DECODE that follows."""
        core = self._change()
        await core.scheduler.adopt(self.id, salt, lora)
        _, logits = await core.prefill(self.id, tokens, 0, want_logits=True)
        assert logits is not None, "asked for"
        return logits

    async def score(
        self, tokens: Sequence[int], top_n: int, *, salt: str | None = None, lora: LoraSet = ()
    ) -> list[TokenLogprobs]:
        """The prompt evaluated anew into the slot with each token's log-probability given
        those before it (``tokens[1:]``, ``top_n`` alternatives each: ``score_prompt``); a
        ``generate`` of the same tokens then starts from its last position's logits."""
        return await score_prompt(self._change(), self.id, tokens, top_n, salt=salt, lora=lora)

    async def sample_first(self, tokens: Sequence[int], params: GenerationParams) -> tuple[GenerationResult, bytes]:
        """A P/D prefill: the prompt in the slot (prefix reuse as generation) and the one token
        it answers with, by generation's own stop rules; with the logits it came from."""
        return await self._change().sample_first(self.id, tokens, params)

    # ---- its KV --------------------------------------------------------------------------

    async def copy_out(
        self, *, logits: bytes | None = None, reserve: Callable[[int], Awaitable[None]] | None = None
    ) -> KvCopy:
        """The slot's KV as a v2 blob (kv/copy.py) (and ``logits``); ``reserve`` is awaited with
        its exact size before any byte is copied. The slot shows as transferring while its
        bytes move (slot_info, the byte budget's readers)."""
        core = self._check()
        slot = core.slots.get(self.id)
        slot.transferring = True
        try:
            return await copy_out(core.backend, core.worker, self.id, logits=logits, reserve=reserve)
        finally:
            slot.transferring = False

    async def restore(
        self, blob: KvBlob, *, timing: CallTiming | None = None, salt: str | None = None, lora: LoraSet = ()
    ) -> None:
        """An admitted blob into the slot, all-or-nothing, as the history of ``salt`` and
        ``lora`` (the cache_salt and LoRA adapter set of the request it serves; None and ():
        unsalted, the base model); idle slots' KV is evicted for its room first."""
        core = self._change()
        backend = core.backend
        if blob.checkpoint is not None:
            check_checkpoint(blob, checkpoint_size=backend.checkpoint_size)
        if blob.n_past >= backend.n_ctx_slot:
            raise ProtocolError(ErrorCode.RESTORE_FAILED, f"blob holds {blob.n_past} positions; "
                                f"{core.inputs.slot_room()}")
        await core.scheduler.make_room(blob.n_past, exclude=self.id)
        slot = core.slots.get(self.id)
        slot.transferring = True
        try:
            await restore_blob(backend, core.worker, self.id, blob, timing, salt, lora)
        finally:
            slot.transferring = False

    def kv_claims(self) -> dict[str, Any]:
        """What the slot's KV was computed under beyond the model, as KV claims carry it: the
        LoRA adapter set (``{"lora": [...]}``), nothing for the base model."""
        core = self._check()
        lora = core.adapters.claims(core.backend.seq_lora[self.id])
        return {"lora": lora} if lora else {}

    async def clear(self) -> int:
        """Empty the slot's KV; the positions it held."""
        core = self._change()
        n = core.n_past(self.id)
        await core.clear_slot(self.id)
        return n


async def score_prompt(
    core: EngineCore, slot: int, tokens: Sequence[int], top_n: int, *, salt: str | None, lora: LoraSet = ()
) -> list[TokenLogprobs]:
    """The log-probability of each of ``tokens[1:]`` given those before it, with its
    ``top_n`` most likely alternatives; the slot then holds the prompt and its last
    position's logits (under the request's cache ``salt`` and adapter set ``lora``)."""
    backend, scheduler = core.backend, core.scheduler
    await scheduler.keep_history(slot, 0)
    await scheduler.adopt(slot, salt, lora)
    await scheduler.make_room(len(tokens) - backend.n_past(slot), exclude=slot)
    out: list[TokenLogprobs] = []
    done = 0
    while done < len(tokens):
        budget = core.settings.step_token_budget if core.batcher.generating > 0 else backend.n_batch
        part = list(tokens[done : done + min(budget, backend.n_batch)])
        after = list(tokens[done + 1 : done + len(part) + 1])  # each row's next token
        last = done + len(part) == len(tokens)

        def rows(logits: np.ndarray, after: list[int] = after) -> None:
            out.extend(token_logprobs(logits[i], t, top_n) for i, t in enumerate(after))

        def call(abort: threading.Event, part: list[int] = part, keep: int = done, last: bool = last) -> None:
            if backend.truncate_slot(slot, keep) != keep:
                raise ProtocolError(ErrorCode.INTERNAL, f"slot {slot}: its KV could not "
                                    f"be cut back to {keep} positions")
            backend.eval_chunk(slot, part, abort, want_logits=last, rows=rows)

        try:
            await core.worker.run(call)
        except DecodeAborted:
            await trio.lowlevel.checkpoint()  # the cancellation that raised the flag
            raise
        except NoKvSpace:
            raise ProtocolError(ErrorCode.INTERNAL, "KV cache full: the prompt needs "
                                f"{len(tokens)} positions in slot {slot}") from None
        done += len(part)
        core._chunk_prompt_tokens += len(part)  # the engine's prompt figures count them
    return out
