"""What the HTTP and RPC front ends share: settings, metrics and the running services.

The composition root (``app.py``) fills it in as the parts start; nothing here imports the
front ends, so ``http/`` and ``rpc/`` depend on this module and never on ``app.py``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

import trio

from ..concurrency import ByteBudget
from ..config import Settings
from ..observability import Metrics

if TYPE_CHECKING:
    from ..decode.manager import DecodeManager
    from ..engine import Engine
    from ..handoff.exports import ExportStore
    from ..observability import KvEventPublisher
    from .model_pool import ModelPool

log = logging.getLogger("hydra_trio")


def _llama_version() -> str:
    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class AppState:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    engine: Engine | None = None  # set once the model is loaded (several: the RPC model's)
    models: ModelPool | None = None  # every model by name (one, or several: serving/model_pool.py)
    decodes: DecodeManager | None = None  # set once the decode manager runs
    # Payload bytes held by RPC requests and HTTP state uploads together (--max-inflight-bytes).
    payload_budget: ByteBudget = field(init=False)
    exports: ExportStore | None = None  # KV exports awaiting KV_PULL (P/D hand-off via a router)
    rpc_port: int | None = None  # set once the RPC listener runs (advertised in kv_transfer_params)
    kv_events: KvEventPublisher | None = None  # --kv-events-endpoint: bound before the model loads
    startup_phase: str = "starting"
    # Set by the first SIGTERM/SIGINT: new work is refused (HTTP 503, RPC BUSY) while what
    # runs finishes; /health says "draining" so load balancers stop sending.
    draining: bool = False
    http_in_flight: int = 0  # HTTP exchanges from request to last body byte (http/server.py)
    started_at: float = field(default_factory=time.time)
    llama_cpp_version: str = field(default_factory=_llama_version)
    log: logging.Logger = log

    def begin_drain(self) -> None:
        """Refuse new completions, PREFILLs and DECODEs from now on; the rest goes on."""
        self.draining = True
        if self.decodes is not None:
            self.decodes.close_to_new()

    def in_flight(self) -> str | None:
        """What still runs (a short description), or None: HTTP exchanges (a stream until its
        last byte), requests holding or waiting for a slot, DECODEs, KV exports a decode
        engine has not pulled yet."""
        decodes, exports = self.decodes, self.exports
        parts = []
        if self.http_in_flight:
            parts.append(f"{self.http_in_flight} HTTP requests")
        for name, engine in self._engines():
            stats = engine.stats()
            if stats.slots_busy or stats.requests_waiting:
                of = f" ({name})" if name else ""
                parts.append(f"{stats.slots_busy} slots busy, {stats.requests_waiting} waiting{of}")
        if decodes is not None and decodes.store.running():
            parts.append(f"{len(decodes.store.running())} decodes")
        if exports is not None and len(exports):
            parts.append(f"{len(exports)} KV exports not pulled")
        return ", ".join(parts) or None

    def _engines(self) -> list[tuple[str | None, Engine]]:
        """Every serving engine, named when the process serves several models."""
        if self.models is not None:
            return [(e.name if self.models.strict else None, engine) for e, engine in self.models.loaded()]
        return [] if self.engine is None else [(None, self.engine)]

    async def wait_drained(self) -> None:
        """Return once nothing is in flight (bounded by the caller's scope). A slot release
        of the RPC model wakes it; other models' slots and exports (which end by their pull or
        their lease, on their own task) are looked at every 100 ms."""
        while self.in_flight() is not None:
            with trio.move_on_after(0.1):
                if self.engine is not None:
                    await self.engine.wait_slot_released()

    def __post_init__(self) -> None:
        self.payload_budget = budget = ByteBudget(self.settings.max_inflight_bytes)
        self.metrics.live_gauge(
            "hydra_payload_bytes_held", "payload bytes held by RPC requests and HTTP uploads", lambda: budget.used
        )


@dataclass(frozen=True)
class Endpoints:
    """What a started engine tells its caller: its ports and its shared state."""

    http_port: int
    rpc_port: int
    state: AppState
