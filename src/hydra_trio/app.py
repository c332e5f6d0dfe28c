"""Composition root: builds every part and runs them; nothing imports this module but the
entry points (``cli.py``, ``local.py``).

Start order (each with ``nursery.start``, so the next part starts only once the previous one
is ready): HTTP (answers /health 503 "starting" while the model loads) -> the model pool and
its first engine (the one --model, or the RPC model and the pinned ones of several) ->
decode manager -> KV export store (lease expiry) -> RPC listener.

Lifetimes nest: the front ends (HTTP, RPC) end first, then the decode manager's requests,
then the model pool and its engines, so nothing waits on a step of a closed engine.
"""

from __future__ import annotations

import gc
import logging

import trio

from .concurrency import start_service
from .config import Settings
from .decode.manager import DecodeManager
from .decode.store import ResultStore
from .engine import Engine
from .handoff.exports import ExportStore
from .handoff.shm import ShmArea
from .http.server import serve_http
from .model.catalog import Catalog, read_catalog
from .observability import log_stats, open_kv_events
from .rpc.listener import open_rpc_listeners, serve_rpc
from .serving import AppState, Endpoints, ModelPool

log = logging.getLogger("hydra_trio")

# How long the shutdown waits for cancelled requests to stop (each stops within
# milliseconds: a cancelled llama call aborts; this only bounds a wedged one).
_STOP_WAIT_S = 30.0


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


def catalog_of(settings: Settings) -> Catalog | None:
    """The models served by name (``--model NAME=PATH``, ``--models-dir``); None: one model."""
    if not (settings.named_models or settings.models_dir):
        if settings.model_pin or settings.rpc_model:
            raise SystemExit("--model-pin and --rpc-model name models of --model NAME=PATH or --models-dir")
        return None
    if settings.model or settings.alias:
        raise SystemExit("give --model PATH (and --alias) for one model, or "
                         "--model NAME=PATH and/or --models-dir for several")
    return read_catalog(settings.named_models, settings.models_dir, settings.model_pin, settings.rpc_model)


async def serve(settings: Settings, *, task_status: trio.TaskStatus[Endpoints] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the whole engine until cancelled."""
    catalog = catalog_of(settings)  # a bad flag stops here, before any port is bound
    state = AppState(settings=settings)
    pool = ModelPool(settings, catalog)
    decodes: DecodeManager | None = None
    try:
        async with trio.open_nursery() as services:  # engine and decode manager: they end last
            try:
                async with trio.open_nursery() as front:  # HTTP and RPC: they end first
                    http_port = await front.start(serve_http, state)
                    log.info("HTTP listening on http://%s:%d", settings.host, http_port)
                    rpc_listeners = await open_rpc_listeners(settings)  # a port in use stops us here
                    state.kv_events = open_kv_events(settings, state.metrics.registry)  # also here
                    state.startup_phase = "loading model"
                    await start_service(services, pool.run)
                    if catalog is None:
                        model_path, alias = await trio.to_thread.run_sync(resolve_model, settings)
                        await pool.adopt(await Engine.load(model_path, settings, alias=alias), model_path)
                    else:
                        await pool.start_pinned()
                    engine = pool.engine(pool.default_name)  # the RPC's, the decode manager's
                    state.models = pool
                    if settings.sleep_idle_seconds > 0 and all(e.pinned for e in pool.entries()):
                        log.warning("--sleep-idle-seconds: no model sleeps here "
                                    "(the RPC model and pinned ones never do)")
                    store = ResultStore(ttl_s=settings.decode_result_ttl_s, max_entries=settings.decode_result_max)
                    state.metrics.watch_models(
                        pool, engine, lambda: len(store.running()), settings.kv_events_block_size
                    )
                    if settings.log_stats_interval_s > 0:  # reads the engine: ends with the front ends
                        front.start_soon(log_stats, engine, settings.log_stats_interval_s)
                    decodes = DecodeManager(engine, store, settings, state.metrics)
                    await start_service(services, decodes.run)
                    exports = ExportStore(
                        max_bytes=settings.kv_export_max_bytes,
                        ttl_s=settings.kv_export_ttl_s,
                        registry=state.metrics.registry,
                        shm=ShmArea.open(settings.kv_shm_dir) if settings.kv_shm_dir else None,
                    )
                    await services.start(exports.run)
                    log.info(
                        "KV hand-offs may pull "
                        "from %s (--kv-pull-allow)", ", ".join(map(str, settings.kv_pull_networks()))
                    )
                    state.engine, state.decodes, state.exports = engine, decodes, exports
                    if state.kv_events is not None:
                        state.kv_events.set_model(engine.served_name)  # the topic's {model}
                        events = engine.kv_events(state.kv_events.publish, state.kv_events.block_size)
                        state.metrics.live_gauge(
                            "hydra_kv_blocks_held", "distinct KV blocks the "
                            "slots hold (as KV events told)", lambda: events.n_held
                        )
                        await front.start(state.kv_events.serve, events.resync)
                    rpc_port = await front.start(serve_rpc, state, rpc_listeners)
                    state.rpc_port = rpc_port
                    if settings.advertise_host is None and settings.host in ("0.0.0.0", "::", ""):
                        log.warning(
                            "KV exports will name RPC host %r, which other machines cannot reach: "
                            "set --advertise-host to this engine's address", settings.host
                        )
                    state.startup_phase = "ready"
                    # What start-up made lives as long as the process: out of the cyclic
                    # collector's sight, a full collection no longer walks it (~40 ms each
                    # time here, a pause every stream would wait for), as vLLM does too.
                    gc.collect()
                    gc.freeze()
                    log.info("ready: HTTP port %d, RPC port %d", http_port, rpc_port)
                    task_status.started(Endpoints(http_port, rpc_port, state))
                    await trio.sleep_forever()
            finally:
                # The front ends have ended: stop the services that outlive them, innermost first.
                if decodes is not None:
                    with trio.CancelScope(shield=True), trio.move_on_after(_STOP_WAIT_S):
                        await decodes.stop()
                pool.stop()
    finally:
        if state.kv_events is not None:  # after the engine's last call (later events are dropped)
            state.kv_events.close()

