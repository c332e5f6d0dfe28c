"""Scheduling: which slot a prompt takes, how much of its KV the prompt continues, what is
evicted for room, and what the host prompt cache keeps and gives back (vLLM's scheduler and
KV cache manager). Each policy here is the one place it is decided; the engine asks it
before every prefill, export and restore."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import trio

from ...config import Settings
from ...wire.errors import ProtocolError
from ..kv import CacheHit, HostTiers, KvOwner, Retention
from ..llama import DecodeAborted, LlamaBackend, LoraSet, Snapshot, common_prefix_len
from ..worker import GpuWorker
from .slots import SlotTable

if TYPE_CHECKING:
    from ..output import GenerationResult

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
        tiers: HostTiers | None,
        retention: Retention,
    ) -> None:
        self._backend = backend
        self._worker = worker
        self._slots = slots
        self._settings = settings
        self._tiers = tiers
        self._cache = tiers.ram if tiers is not None else None
        self._disk = tiers.disk if tiers is not None else None
        self.retention = retention
        # Whose history each slot holds (None: a one-off request's, or nobody's): set when a
        # claim that changed the slot's KV ends (``settle``), read by every eviction.
        self.slot_owner: list[KvOwner | None] = [None] * len(slots)
        # Slots whose history a swap_in is copying out to RAM now (its tokens, salt), and the
        # event each such copy sets when it has landed.
        self._leaving: dict[int, tuple[list[int], str | None, LoraSet]] = {}
        self._left = trio.Event()

    def reuse_plan(
        self, slot: int, tokens: Sequence[int], salt: str | None = None, lora: LoraSet = ()
    ) -> tuple[int, bytes | None]:
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

    async def bring(
        self, slot: int, tokens: Sequence[int], salt: str | None, lora: LoraSet, res: GenerationResult
    ) -> bytes | None:
        """Bring the slot to continue the prompt under ``salt`` and the LoRA adapter set ``lora`` as far as any tier
        holds it (the slot, the prompt cache), the slot's own history kept first; the plan goes into
        ``res`` (what is reused, from where, what is left to evaluate). Returns the logits
        to sample the first token from when nothing is left; else the slot is cut to the
        plan, here, where the plan can still change: a memory that refuses a partial cut
        (recurrent, hybrid) was emptied, and the whole prompt is evaluated."""
        from_tier, tier = await self.swap_in(slot, tokens, salt, lora)
        res.n_common, logits = self.reuse_plan(slot, tokens, salt, lora)
        res.n_host = min(from_tier, res.n_common) if tier == "ram" else 0
        res.n_disk = min(from_tier, res.n_common) if tier == "disk" else 0
        res.logits_reused = logits is not None
        await self.keep_history(slot, res.n_common)
        await self.adopt(slot, salt, lora)
        if logits is not None:
            return logits
        res.n_common = await self.cut(slot, res.n_common)
        res.n_host, res.n_disk = min(res.n_host, res.n_common), min(res.n_disk, res.n_common)
        res.n_prompt_processed = len(tokens) - res.n_common
        return None

    async def cut(self, slot: int, n_keep: int) -> int:
        """Drop the slot's positions past ``n_keep`` (its history went to the prompt cache
        first: ``keep_history``); returns the positions it kept, 0 when the memory refused a
        partial removal and the slot was emptied (``LlamaBackend.truncate_slot``)."""
        backend = self._backend()
        if n_keep >= backend.n_past(slot):
            return n_keep
        return await self._worker.call(lambda: backend.truncate_slot(slot, n_keep))

    async def make_room(self, needed: int, *, exclude: int) -> None:
        """Free the KV of idle slots (by the retention order, then least recently used)
        until ``needed`` more cells fit in the shared cache. A victim is claimed while it is
        cleared, so no request can start on it halfway."""
        backend = self._backend()
        rank = self.retention.rank
        while backend.pool_is_tight(needed):
            idle = [
                s for s in self._slots.slots
                if not s.busy and s.id != exclude and backend.n_past(s.id) > 0
            ]
            if not idle:
                return  # nothing to free: llama.cpp reports the shortage
            victim = min(idle, key=lambda s: (rank(self.slot_owner[s.id]), s.last_used))
            log.info("KV cache full: evicting idle slot %d (%d positions)", victim.id, backend.n_past(victim.id))
            self.retention.evicted("slot", self.slot_owner[victim.id])
            await self._clear_idle(victim.id)

    async def _clear_idle(self, slot: int) -> None:
        """Empty an idle slot, claimed meanwhile so that no request starts on it halfway."""
        held = self._slots.claim(slot, "evict")
        try:
            await self._worker.call(lambda: self._backend().clear_slot(slot))
            self.slot_owner[slot] = None
        finally:
            self._slots.release(held)

    def settle(self, slot: int, owner: KvOwner | None) -> None:
        """A claim that changed the slot's KV ended: the history is ``owner``'s now."""
        self.slot_owner[slot] = owner

    async def release(self, owners: set[KvOwner]) -> tuple[int, int, int]:
        """Drop these sessions' KV at once (their tree was finished): their idle slots are
        emptied and their entries in RAM and on disk dropped. Returns how many of each."""
        slots = 0
        for slot in self._slots.slots:
            if slot.busy or self.slot_owner[slot.id] not in owners or not self._backend().n_past(slot.id):
                continue
            try:
                await self._clear_idle(slot.id)
            except ProtocolError:  # a T2/T3 change is emptying every slot anyway
                continue
            slots += 1
        ram, disk = self._tiers.release(owners) if self._tiers is not None else (0, 0)
        return slots, ram, disk

    def slot_rank(
        self, prompt: Sequence[int], salt: str | None = None, lora: LoraSet = ()
    ) -> Callable[[int], tuple[float, ...]]:
        """The slot-choice policy, as a score of each slot for this prompt (higher is better;
        claim_any breaks ties by least recently used): a slot whose KV shares at least
        ``--slot-prompt-similarity`` of the prompt, the longest shared prefix first; then an
        empty slot; then any, the history the retention order ranks lowest first. A 9-token
        chat template head does not make a prompt take over another session's history.

        Scored for every free slot of every claim, so most slots are settled by their first
        few tokens: a slot that differs from the prompt within them shares less than the
        least prefix that counts."""
        # the least shared prefix that counts
        least = max(1, math.ceil(self._settings.slot_prompt_similarity * len(prompt)))
        head = list(prompt[: min(least, HEAD_TOKENS)])
        n_head = len(head)
        rank = self.retention.rank

        def score(slot: int) -> tuple[float, ...]:
            backend = self._backend()  # the model serving when the slot is taken (a claim may wait out a reload)
            held = backend.seq_tokens[slot]
            if not held:
                return 0, 1  # an empty slot shares nothing
            # Among slots it would overwrite, the history the retention order ranks lowest.
            keep = tuple(-x for x in rank(self.slot_owner[slot]))
            if held[:n_head] != head:
                return 0, 0, *keep
            # What the slot can continue, not what it shares: a sliding window may have
            # dropped what a shared prefix needs, and then an empty slot is as good.
            n_common = backend.reusable_prefix(slot, backend.shared_prefix(slot, prompt, salt, lora))
            return (n_common if n_common >= least else 0), 0, *keep

        return score

    async def keep_history(self, slot: int, n_keep: int) -> None:
        """Before the slot drops what it holds past ``n_keep``: copy it into the prompt
        cache, when that is a block's worth or more."""
        cache = self._cache
        if cache is None or self._backend().n_past(slot) - n_keep < MIN_CACHED_TOKENS:
            return
        backend = self._backend()
        self._leaving[slot] = (list(backend.seq_tokens[slot]), backend.seq_salt[slot], backend.seq_lora[slot])
        try:
            snap = await self._worker.call(lambda: self._backend().snapshot(slot))
            self._keep(slot, snap, self.slot_owner[slot])
        finally:
            self._landed(slot)

    def _keep(self, slot: int, snap: Snapshot, owner: KvOwner | None) -> None:
        cache = self._cache
        assert cache is not None
        if cache.put(snap, owner):
            log.debug("prompt cache: kept slot %d's %d "
                      "positions (%d entries, %d bytes)", slot, len(snap.tokens), len(cache), cache.nbytes)

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

    async def swap_in(
        self, slot: int, prompt: Sequence[int], salt: str | None = None, lora: LoraSet = ()
    ) -> tuple[int, str]:
        """When a tier past the slots (the prompt cache in RAM, the disk tier) holds more of the
        prompt (under the request's ``salt`` and ``lora``) than the slot does, put the entry that
        holds the most into the slot (the slot's own history goes to RAM). Returns the
        positions put back and their tier ("ram", "disk"; 0 and "": none).

        One GPU-worker call does it all: the slot's history copied out, the entry restored and,
        where nothing of the entry is lost by it, cut to what the prompt continues. Each call
        waits for the step in flight, and a turn that comes back from RAM waited for three
        (benchmarks/agents.py: most later turns of agents that outnumber the slots)."""
        ram, disk = self._cache, self._disk
        if ram is None:
            return 0, ""
        backend = self._backend()
        while True:
            shared = backend.shared_prefix(slot, prompt, salt, lora)
            # Compared by what each could continue (a sliding window may have dropped the rest).
            held = backend.reusable_prefix(slot, min(shared, len(prompt) - 1))
            best: tuple[CacheHit, str, int] | None = None
            for hit, tier, usable in self._tier_hits(prompt, salt, lora):
                if usable >= held + MIN_CACHED_TOKENS and (best is None or usable > best[2]):
                    best = (hit, tier, usable)
            # A history another swap_in is copying out of its slot is in no tier until that
            # call returns: when it holds more of the prompt, it is worth the wait (it is
            # likely this session's own, taken over by another turn a moment ago).
            if not self._arriving(prompt, salt, lora, max(held, best[2] if best else 0) + MIN_CACHED_TOKENS):
                break
            await self._left.wait()
        if best is None:
            return 0, ""
        hit, tier, usable = best
        lent = False
        leaving = self.slot_owner[slot]
        # The slot's history is in no tier until the call below has returned: a turn that
        # wants it meanwhile waits for it (``_arriving``).
        out = backend.n_past(slot) - shared >= MIN_CACHED_TOKENS  # keep_history's rule
        if out:
            self._leaving[slot] = (list(backend.seq_tokens[slot]), backend.seq_salt[slot], backend.seq_lora[slot])
        saved: list[Snapshot] = []
        try:
            # Taken (RAM) or read (disk) before the slot's history is copied out: no other
            # request can take the entry meanwhile, and the copy's room never evicts it.
            if tier == "ram":
                owner = ram.owner_of(hit.key)
                # Borrowed (another session's history sharing a head with the prompt): the
                # entry stays in RAM for its session, and the slot keeps what the prompt uses.
                lent = hit.n_tokens - usable >= MIN_CACHED_TOKENS
                snap = ram.lend(hit.key) if lent else ram.take(hit.key)
            else:
                assert disk is not None
                owner = disk.owner_of(hit.key)
                loaded = await disk.load(hit.key, salt, lora)  # read and checked off the trio thread
                if loaded is None:
                    return 0, ""
                snap = loaded
            await self.make_room(len(snap.tokens), exclude=slot)
            return await self._restore(slot, prompt, salt, lora, snap, owner, tier, out, saved, lent)
        finally:
            if saved:
                self._keep(slot, saved[0], leaving)
            self._landed(slot)

    def _tier_hits(
        self, prompt: Sequence[int], salt: str | None, lora: LoraSet
    ) -> list[tuple[CacheHit, str, int]]:
        """Each tier's (RAM, disk) best entry for the prompt, with what of it the prompt could
        continue (a sliding window may have dropped the rest), at least the last token left to
        compute."""
        backend = self._backend()
        out = []
        for tier, source in (("ram", self._cache), ("disk", self._disk)):
            hit = source.best(prompt, salt, lora) if source is not None else None
            if hit is not None:
                usable = backend.reusable_in_state(hit.n_tokens, min(hit.n_common, len(prompt) - 1), hit.checkpoint_at)
                out.append((hit, tier, usable))
        return out

    def work_left(self, prompt: Sequence[int], salt: str | None = None, lora: LoraSet = ()) -> int:
        """The prompt tokens a request would compute if it had a slot now: the prompt less the
        most that any slot, a history being copied out of one, or a tier past them holds of it.
        The order of the requests waiting for a slot (SlotTable: least work first), asked once
        per waiting request: an estimate, as a waiting turn's histories may move meanwhile."""
        backend = self._backend()
        n = len(prompt)
        if n == 0:
            return 0
        held = max(
            backend.reusable_prefix(s, min(backend.shared_prefix(s, prompt, salt, lora), n - 1))
            for s in range(len(self._slots))
        )
        for tokens, s, lo in self._leaving.values():
            if s == salt and lo == lora:
                held = max(held, min(common_prefix_len(tokens, prompt), n - 1))
        for _hit, _tier, usable in self._tier_hits(prompt, salt, lora):
            held = max(held, usable)
        return n - held

    def _landed(self, slot: int) -> None:
        """The history copied out of ``slot`` is in RAM now (or was not copied): wake the turns
        that wait for it."""
        self._leaving.pop(slot, None)
        self._left.set()
        self._left = trio.Event()

    async def _restore(
        self, slot: int, prompt: Sequence[int], salt: str | None, lora: LoraSet, snap: Snapshot,
        owner: KvOwner | None, tier: str, out: bool, saved: list[Snapshot], lent: bool,
    ) -> tuple[int, str]:
        """``swap_in``'s one GPU-worker call: the slot's history copied into ``saved`` (with
        ``out``), ``snap`` restored, cut to the prompt when that loses nothing (less than a
        block, or ``lent``: the entry is still in RAM)."""
        view = memoryview(snap.buf)

        def call(abort: threading.Event) -> None:
            backend = self._backend()
            if out:
                saved.append(backend.snapshot(slot))
            checkpoint = backend.checkpoint_of(snap, slot)  # made whole before the state is rewritten in place
            backend.state_restore(
                slot,
                view[snap.offset :],
                snap.tokens,
                len(snap.tokens),
                abort,
                blob=view,
                salt=snap.salt,
                lora=snap.lora,
                checkpoint=checkpoint,
            )
            # The cut ``bring`` would make next, when it keeps nothing of the tail (less than a
            # block, or held in RAM still): bring's own plan then finds nothing to cut.
            n_keep, logits = self.reuse_plan(slot, prompt, salt, lora)
            tail = backend.n_past(slot) - n_keep
            if logits is None and tail > 0 and (lent or tail < MIN_CACHED_TOKENS):
                backend.truncate_slot(slot, n_keep)

        try:
            await self._worker.run(call)
        except DecodeAborted:
            await trio.lowlevel.checkpoint()
            raise
        except ProtocolError as err:  # our own state: only a full shared pool refuses it
            log.warning("%s tier: entry of %d positions "
                        "not restored into slot %d: %s", tier, len(snap.tokens), slot, err.message)
            return 0, ""
        # The slot holds that history now: a copy the request makes of it (when it keeps less
        # of it) is still its owner's, whichever request brought it back.
        self.slot_owner[slot] = owner
        log.debug("%s tier: slot %d continues %d cached positions", tier, slot, len(snap.tokens))
        return len(snap.tokens), tier

    def _arriving(self, prompt: Sequence[int], salt: str | None, lora: LoraSet, least: int) -> bool:
        """Whether a history being copied out to RAM holds at least ``least`` of ``prompt``."""
        return any(
            s == salt and lo == lora and common_prefix_len(tokens, prompt) >= least
            for tokens, s, lo in self._leaving.values()
        )
