"""Typed snapshots of the engine for its readers (metrics, logs, /health, /slots, STATE_META,
drain), filled in one place (readout.py), so no reader counts slots itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .kv import DiskStats, PromptCacheStats
from .sched import ChunkingStats, SessionStats


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine at one moment (``Engine.stats()``); counters only grow."""

    slots: int
    slots_busy: int  # claimed by a request, from its claim to its release
    requests_waiting: int  # waiting in line for a free slot
    kv_cells_total: int  # KV cells all slots share (n_ctx)
    kv_cells_used: int  # positions held by all slots, idle ones' prefix caches included
    kv_cells_running: int  # positions held by busy slots
    tokens_generated: int
    prompt_tokens_processed: int
    tokens_evaluated: int  # prompt + step tokens
    step_batches: int
    step_tokens: int
    step_prompt_tokens: int  # prompt tokens inside step batches (chunked prefill)
    worker_busy_s: float
    worker_calls: int
    llama_decode_s: float
    model_load_s: float
    spec_drafts: int = 0  # speculation: drafts verified
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # draft tokens accepted
    # A generation step's measured llama_decode seconds by its rows (engine/speculation/ StepCost).
    step_decode_s: tuple[tuple[int, float], ...] = ()
    t3_reloads: int = 0  # CONFIGURE T3 model reloads done
    last_t3_reload_ms: float = 0.0
    prompt_cache: PromptCacheStats | None = None  # None: --cache-ram-mib 0
    sessions: SessionStats | None = None  # agent sessions (engine/sched/session_tree.py)
    disk: DiskStats | None = None  # the disk tier (--cache-disk); None: off
    # KV histories evicted for room, by tier and kind (kv/retention.py): ((tier, kind, count), ...)
    evictions: tuple[tuple[str, str, int], ...] = ()
    # Prompt parts beside running streams: the ITL target in force (engine/sched/chunks.py).
    chunking: ChunkingStats | None = None

    @property
    def slots_idle(self) -> int:
        return self.slots - self.slots_busy

    @property
    def kv_cache_usage(self) -> float:
        """KV held by running requests, of all cells (0..1). An idle slot's KV is a prefix
        cache that make_room() evicts on demand, as vLLM counts its cached-but-free blocks
        as free."""
        return min(1.0, self.kv_cells_running / self.kv_cells_total) if self.kv_cells_total else 0.0

    @property
    def step_batch_mean_size(self) -> float:
        return self.step_tokens / self.step_batches if self.step_batches else 0.0


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """One slot as /slots and STATE_META describe it (``Engine.slot_info``)."""

    id: int
    owner: str | None  # what holds it; None: idle
    transferring: bool  # a STATE_GET/PUT is moving its bytes
    n_past: int
    n_ctx: int  # the most positions it can hold
    state_size: int  # its serialized llama state, exact

    @property
    def busy(self) -> bool:
        return self.owner is not None

    def fields(self) -> dict[str, Any]:
        """The names both descriptions share (llama-server's)."""
        return {
            "n_past": self.n_past,
            "state_size": self.state_size,
            "is_processing": self.busy,
            "is_transferring": self.transferring,
        }
