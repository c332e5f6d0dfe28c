"""What the engine's readers see of its core: the figures counted once (``stats``: metrics,
logs, /health, the drain), a slot's description (/slots, STATE_META), where the model runs
(/version, INFO), and the KV events feed (routers that route by cache). It changes with what
operators read; the core (core.py) with how requests run. It only reads the core, but for
the feed's watch on the GPU worker and the host tiers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..wire.kvevents import Event
from .kv import SlotBlocks
from .speculation import DraftPlanner
from .stats import EngineStats, SlotInfo

if TYPE_CHECKING:
    from .core import EngineCore


class KvEvents(Protocol):
    """What ``Engine.kv_events`` gives: tell everything anew, and how many blocks are held."""

    async def resync(self) -> None: ...

    @property
    def n_held(self) -> int: ...


class Readout:
    """The readers' view of one ``EngineCore`` (engine.py's ``Engine`` hands it out)."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        # The slots' KV blocks, for KV events (engine/kv/blocks.py); None: nobody subscribes.
        self.kv_blocks: SlotBlocks | None = None

    def stats(self) -> EngineStats:
        """A snapshot for metrics, logs and /health: no reader counts slots itself."""
        core = self._core
        slots, batcher, worker = core.slots, core.batcher, core.worker
        return EngineStats(
            slots=len(slots),
            slots_busy=slots.n_busy,
            requests_waiting=slots.waiting,
            kv_cells_total=core.n_ctx,
            kv_cells_used=core.backend.cells_in_use(),
            kv_cells_running=sum(core.backend.n_past(s.id) for s in slots.slots if s.busy),
            tokens_generated=core.tokens_generated,
            prompt_tokens_processed=core.prompt_tokens_processed,
            tokens_evaluated=core.tokens_evaluated,
            step_batches=batcher.batches,
            step_tokens=batcher.tokens,
            step_prompt_tokens=batcher.prompt_tokens,
            worker_busy_s=worker.busy_s,
            worker_calls=worker.calls,
            llama_decode_s=core.backend.decode_s,
            model_load_s=core.model_load_ms / 1000.0,
            spec_drafts=core.spec_counts.drafts,
            spec_draft_tokens=core.spec_counts.draft_tokens,
            spec_accepted_tokens=core.spec_counts.accepted,
            step_decode_s=tuple(sorted(self._planner().step_cost.measured().items())),
            t3_reloads=core.t3_reloads,
            last_t3_reload_ms=core.last_t3_reload_ms,
            prompt_cache=None if core.prompt_cache is None else core.prompt_cache.stats(),
            sessions=core.sessions.stats(),
            disk=core.tiers.disk_stats(),
            evictions=core.retention.counts(),
            chunking=batcher.chunks.report(),
        )

    def _planner(self) -> DraftPlanner:
        planner = self._core.backend.planner
        assert isinstance(planner, DraftPlanner), "set when the backend is taken"
        return planner

    def slot_info(self, slot_id: int) -> SlotInfo:
        """The one description of a slot (/slots, STATE_META); NO_SLOT for an unknown id."""
        core = self._core
        slot = core.slots.get(slot_id)
        return SlotInfo(
            slot.id, slot.owner, slot.transferring, core.n_past(slot_id), core.n_ctx_slot, core.state_size(slot_id)
        )

    def runtime_fields(self) -> dict[str, Any]:
        """Where the model runs (ggml devices, layers offloaded, flash attention), how its KV
        cache is laid out, which chat template renders prompts and which LoRA adapters it
        loaded: for /version and INFO."""
        core = self._core
        offload = core.backend.offload
        assert offload is not None, "set when the context is built"
        return {
            **offload.as_dict(),
            "kv_unified": core.backend.kv_unified,
            "n_ctx_slot": core.n_ctx_slot,
            "kv_cache": core.backend.cache_layout,  # type_k, type_v, v_trans
            "chat_template": core.inputs.chat_template.as_dict(),
            "lora_adapters": core.adapters.listing(),  # GET /lora-adapters' list ([]: none loaded)
        }

    def kv_events(self, publish: Callable[[list[Event]], None], block_size: int) -> KvEvents:
        """From now on, every change of what the slots hold goes to ``publish`` as KV events,
        after the GPU-worker call that made it (on the trio thread); the handle's ``resync``
        tells everything anew (for a new subscriber)."""
        core = self._core
        self.kv_blocks = SlotBlocks(core.backend.n_slots, block_size, core.adapters.event_fields)
        core.worker.after_call = self.kv_blocks.watch(core.backend, publish)
        core.slots_emptied_watch = self.kv_blocks.rewatch  # a T2/T3 change's new context
        # histories in RAM and on disk: media CPU, DISK, each with its adapter set's fields
        core.tiers.watch(block_size, publish, core.adapters.event_fields)
        return _KvEventsHandle(self, self.kv_blocks)

    async def resync_kv_events(self) -> None:
        """Tell everything the slots hold anew (for a new subscriber), between worker calls."""
        core = self._core
        if self.kv_blocks is not None:
            await core.worker.call(self.kv_blocks.resync)  # AllBlocksCleared, then the slots'
        core.tiers.publish_resync()


@dataclass(frozen=True, slots=True)
class _KvEventsHandle:
    readout: Readout
    blocks: SlotBlocks

    async def resync(self) -> None:
        await self.readout.resync_kv_events()

    @property
    def n_held(self) -> int:
        return self.blocks.n_held
