"""Scheduling: which slot a prompt takes, how much of its KV the prompt continues, what is
evicted for room, and what the host prompt cache keeps and gives back (vLLM's scheduler and
KV cache manager). Each policy here is the one place it is decided; the engine asks it
before every prefill, export and restore."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence

import trio

from ...config import Settings
from ...wire.errors import ProtocolError
from ..kv import CacheHit, PromptCache
from ..llama import DecodeAborted, LlamaBackend, LoraSet
from ..worker import GpuWorker
from .slots import SlotTable

log = logging.getLogger(__name__)

# A slot's history goes to the prompt cache when it would drop at least this many positions
# (a KV-event block), and an entry comes back when it holds at least this many more.
MIN_CACHED_TOKENS = 16
# The slot choice compares this many leading tokens before the whole shared prefix.
HEAD_TOKENS = 4


class SlotScheduler:
    """Slot choice, prefix reuse, eviction and the prompt cache, over the model serving now
    (``backend``: a T3 reload replaces it)."""

    def __init__(
        self,
        backend: Callable[[], LlamaBackend],
        worker: GpuWorker,
        slots: SlotTable,
        settings: Settings,
        cache: PromptCache | None,
    ) -> None:
        self._backend = backend
        self._worker = worker
        self._slots = slots
        self._settings = settings
        self._cache = cache

    def reuse_plan(self, slot: int, tokens: Sequence[int], salt: str | None = None, lora: LoraSet = ()) -> tuple[int, bytes | None]:
        """How much of the slot's KV a prompt continues from: the one prefix-reuse policy of
        every path that continues a slot (generation, the P/D export).

        Returns ``(n_keep, logits)``. With logits, the slot holds exactly the prompt and the
        logits of its last position: nothing is evaluated, the first token is sampled from
        them. Otherwise keep ``n_keep`` positions and evaluate the rest: at least the last
        prompt token (for its logits), and nothing of a sliding window the slot has dropped.
        """
        backend = self._backend()
        cached = backend.seq_tokens[slot]
        n_common = backend.shared_prefix(slot, tokens, salt, lora)
        if n_common == len(tokens):
            logits = backend.tail_logits[slot]
            if logits is not None and n_common == len(cached):
                return n_common, logits
            n_common -= 1  # re-evaluate the last prompt token for its logits
        return backend.reusable_prefix(slot, n_common), None

    async def cut(self, slot: int, n_keep: int) -> int:
        """Drop the slot's positions past ``n_keep`` (its history went to the prompt cache
        first: ``keep_history``); returns the positions it kept, 0 when the memory refused a
        partial removal and the slot was emptied (``LlamaBackend.truncate_slot``)."""
        backend = self._backend()
        if n_keep >= backend.n_past(slot):
            return n_keep
        return await self._worker.call(lambda: backend.truncate_slot(slot, n_keep))

    async def make_room(self, needed: int, *, exclude: int) -> None:
        """Free the KV of idle slots (least recently used first) until ``needed`` more cells
        fit in the shared cache. A victim is claimed while it is cleared, so no request can
        start on it halfway."""
        backend = self._backend()
        while backend.pool_is_tight(needed):
            idle = [
                s for s in self._slots.slots
                if not s.busy and s.id != exclude and backend.n_past(s.id) > 0
            ]
            if not idle:
                return  # nothing to free: llama.cpp reports the shortage
            victim = min(idle, key=lambda s: s.last_used)
            self._slots.claim(victim.id, "evict")
            try:
                log.info("KV cache full: evicting idle slot %d (%d positions)", victim.id, backend.n_past(victim.id))
                await self._worker.call(lambda v=victim.id: backend.clear_slot(v))
            finally:
                self._slots.release(victim)

    def slot_rank(self, prompt: Sequence[int], salt: str | None = None, lora: LoraSet = ()) -> Callable[[int], tuple[int, int]]:
        """The slot-choice policy, as a score of each slot for this prompt (higher is better;
        claim_any breaks ties by least recently used): a slot whose KV shares at least
        ``--slot-prompt-similarity`` of the prompt, the longest shared prefix first; then an
        empty slot; then any. A 9-token chat template head does not make a prompt take over
        another session's history.

        Scored for every free slot of every claim, so most slots are settled by their first
        few tokens: a slot that differs from the prompt within them shares less than the
        least prefix that counts."""
        least = max(1, math.ceil(self._settings.slot_prompt_similarity * len(prompt)))  # the least shared prefix that counts
        head = list(prompt[: min(least, HEAD_TOKENS)])
        n_head = len(head)

        def score(slot: int) -> tuple[int, int]:
            backend = self._backend()  # the model serving when the slot is taken (a claim may wait out a reload)
            held = backend.seq_tokens[slot]
            if not held:
                return 0, 1  # an empty slot shares nothing
            if held[:n_head] != head:
                return 0, 0
            # What the slot can continue, not what it shares: a sliding window may have
            # dropped what a shared prefix needs, and then an empty slot is as good.
            n_common = backend.reusable_prefix(slot, backend.shared_prefix(slot, prompt, salt, lora))
            return (n_common if n_common >= least else 0), 0

        return score

    async def keep_history(self, slot: int, n_keep: int) -> None:
        """Before the slot drops what it holds past ``n_keep``: copy it into the prompt
        cache, when that is a block's worth or more."""
        cache = self._cache
        if cache is None or self._backend().n_past(slot) - n_keep < MIN_CACHED_TOKENS:
            return
        snap = await self._worker.call(lambda: self._backend().snapshot(slot))
        if cache.put(snap):
            log.debug("prompt cache: kept slot %d's %d positions (%d entries, %d bytes)", slot, len(snap.tokens), len(cache), cache.nbytes)

    async def adopt(self, slot: int, salt: str | None, lora: LoraSet = ()) -> None:
        """Make the slot's history ``salt``'s and the LoRA adapter set ``lora``'s: from now on
        its batches run under that set. A request under another salt or set than the slot's
        continues none of it (``shared_prefix`` gave 0, and the prompt cache has it now), so
        the slot is emptied before it is relabelled: no position computed under one salt or
        set ever carries another (a prefill cancelled before its first chunk would leave them)."""
        backend = self._backend()
        if backend.seq_salt[slot] == salt and backend.seq_lora[slot] == lora:
            return
        if backend.seq_tokens[slot]:
            await self._worker.call(lambda: backend.clear_slot(slot))
        backend.seq_salt[slot], backend.seq_lora[slot] = salt, lora

    async def swap_in(self, slot: int, prompt: Sequence[int], salt: str | None = None, lora: LoraSet = ()) -> int:
        """When the prompt cache holds more of the prompt (under the request's ``salt`` and ``lora``) than
        the slot does, put that entry into the slot (the slot's own history goes to the
        cache first). Returns the positions put back (0: none)."""
        cache = self._cache
        if cache is None:
            return 0
        backend = self._backend()
        shared = backend.shared_prefix(slot, prompt, salt, lora)
        # Compared by what each could continue (a sliding window may have dropped the rest).
        held = backend.reusable_prefix(slot, min(shared, len(prompt) - 1))

        def worth_it() -> CacheHit | None:
            hit = cache.best(prompt, salt, lora)
            if hit is None:
                return None
            usable = backend.reusable_in_state(hit.n_tokens, min(hit.n_common, len(prompt) - 1))
            return hit if usable >= held + MIN_CACHED_TOKENS else None

        if worth_it() is None:
            return 0
        await self.keep_history(slot, shared)
        # Looked up again: while the slot's history was copied, another request with the
        # same prompt may have taken the entry (a KeyError, a 500, before).
        hit = worth_it()
        if hit is None:
            return 0
        snap = cache.take(hit.key)
        await self.make_room(len(snap.tokens), exclude=slot)
        view = memoryview(snap.buf)

        def call(abort: threading.Event) -> None:
            self._backend().state_restore(
                slot, view[snap.offset :], snap.tokens, len(snap.tokens), abort, blob=view, salt=snap.salt, lora=snap.lora
            )

        try:
            await self._worker.run(call)
        except DecodeAborted:
            await trio.lowlevel.checkpoint()
            raise
        except ProtocolError as err:  # our own state: only a full shared pool refuses it
            log.warning("prompt cache: entry of %d positions not restored into slot %d: %s", len(snap.tokens), slot, err.message)
            return 0
        log.debug("prompt cache: slot %d continues %d cached positions", slot, len(snap.tokens))
        return len(snap.tokens)
