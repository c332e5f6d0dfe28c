"""Composition root: builds every part and runs them in one root nursery.

Start order (each with nursery.start, so the next part starts only once the previous one is
ready): HTTP (answers /health 503 "starting" while the model loads) -> model + engine ->
decode manager -> RPC listener.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

import trio

from .config import Settings
from .decode.manager import DecodeManager
from .decode.store import ResultStore
from .engine.engine import Engine, GenerationResult
from .http.server import serve_http
from .metrics import Metrics
from .rpc.server import serve_rpc

log = logging.getLogger("hydra_trio")


def _llama_version() -> str:
    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class AppState:
    """What the HTTP and RPC layers share."""

    settings: Settings
    nursery: trio.Nursery  # owner of request-scoped background tasks
    metrics: Metrics = field(default_factory=Metrics)
    engine: Engine | None = None
    decodes: DecodeManager | None = None
    startup_phase: str = "starting"
    started_at: float = field(default_factory=time.time)
    llama_cpp_version: str = field(default_factory=_llama_version)
    log: logging.Logger = log

    def record_generation(self, path: str, res: GenerationResult) -> None:
        m = self.metrics
        m.completion_tokens.labels(path).inc(res.completion_tokens)
        m.prompt_tokens.labels(path).inc(res.n_prompt_processed)
        m.cached_prompt_tokens.labels(path).inc(res.n_common)
        m.ttft_ms.labels(path).observe(res.prompt_ms)  # the engine's own time to first token


@dataclass(frozen=True)
class Endpoints:
    http_port: int
    rpc_port: int
    state: AppState


def resolve_model(settings: Settings) -> tuple[str, str | None]:
    """(model path, alias). Without --model: the synthetic demo model from the user cache."""
    if settings.model:
        from .model.registry import resolve_model_arg  # a file, or a named model (registry)

        path, named_alias = resolve_model_arg(settings.model)
        return str(path), settings.alias or named_alias
    from .model.synthetic import cached_model

    path, written = cached_model("small")
    log.warning(
        "no --model given: serving the SYNTHETIC demo model %s (random weights, its text is "
        "noise; %s). Pass --model PATH for a real GGUF.",
        path,
        "written now" if written else "from the cache",
    )
    return str(path), settings.alias or "hydra-synthetic-small"


async def serve(settings: Settings, *, task_status: trio.TaskStatus[Endpoints] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the whole engine until cancelled."""
    async with trio.open_nursery() as root:
        async with trio.open_nursery() as requests:
            state = AppState(settings=settings, nursery=requests)
            http_port = await root.start(serve_http, state)
            log.info("HTTP listening on http://%s:%d", settings.host, http_port)
            state.startup_phase = "loading model"
            model_path, alias = await trio.to_thread.run_sync(resolve_model, settings)
            engine = await Engine.load(model_path, settings, alias=alias)
            await root.start(engine.run)
            _register_engine_metrics(state, engine)
            store = ResultStore(ttl_s=settings.decode_result_ttl_s, max_entries=settings.decode_result_max)
            state.decodes = DecodeManager(state, engine, store)
            await root.start(state.decodes.run)
            state.engine = engine
            rpc_port = await root.start(serve_rpc, state)
            state.startup_phase = "ready"
            log.info("ready: HTTP port %d, RPC port %d", http_port, rpc_port)
            task_status.started(Endpoints(http_port, rpc_port, state))
            await trio.sleep_forever()


def _register_engine_metrics(state: AppState, engine: Engine) -> None:
    m = state.metrics
    m.add_live("hydra_slots_busy", "slots claimed by a request", lambda: sum(s.busy for s in engine.slots.slots))
    m.add_live("hydra_slots_total", "slots", lambda: len(engine.slots))
    m.add_live("hydra_kv_cells_used", "KV positions held by all slots", engine.backend.cells_in_use)
    m.add_live("hydra_kv_cells_total", "KV cells shared by all slots", lambda: engine.n_ctx)
    m.add_live("hydra_gpu_worker_busy_seconds", "time the GPU worker spent in llama.cpp calls", lambda: engine.worker.busy_s)
    m.add_live("hydra_gpu_worker_calls", "llama.cpp calls made on the GPU worker", lambda: engine.worker.calls)
    m.add_live("hydra_step_batches", "batched generation steps", lambda: engine.batches)
    m.add_live(
        "hydra_step_batch_mean_size",
        "mean number of sequences per generation step",
        lambda: engine.batch_tokens / engine.batches if engine.batches else 0.0,
    )
    m.add_live("hydra_model_load_ms", "model load time", lambda: engine.model_load_ms)
    # Live counters read straight from the engine: they show work done after a cancel.
    m.add_live("hydra_engine_tokens_generated", "tokens sampled by the engine (all paths)", lambda: engine.tokens_generated)
    m.add_live(
        "hydra_engine_prompt_tokens_processed",
        "prompt tokens evaluated by the engine (all paths)",
        lambda: engine.prompt_tokens_processed,
    )
    m.add_live("hydra_engine_step_tokens", "tokens evaluated by batched generation steps", lambda: engine.batch_tokens)
    m.add_live("hydra_engine_tokens_evaluated", "prompt + step tokens evaluated by llama.cpp", lambda: engine.tokens_evaluated)
