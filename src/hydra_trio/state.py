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

from .config import Settings
from .metrics import Metrics
from .rpc.connection import ByteBudget

if TYPE_CHECKING:
    from .decode.exports import ExportStore
    from .decode.manager import DecodeManager
    from .engine.engine import Engine

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
    engine: Engine | None = None  # set once the model is loaded
    decodes: DecodeManager | None = None  # set once the decode manager runs
    # Payload bytes held by RPC requests and HTTP state uploads together (--max-inflight-bytes).
    payload_budget: ByteBudget = field(init=False)
    exports: ExportStore | None = None  # KV exports awaiting KV_PULL (P/D hand-off via a router)
    rpc_port: int | None = None  # set once the RPC listener runs (advertised in kv_transfer_params)
    startup_phase: str = "starting"
    started_at: float = field(default_factory=time.time)
    llama_cpp_version: str = field(default_factory=_llama_version)
    log: logging.Logger = log

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
