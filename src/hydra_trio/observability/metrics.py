"""Prometheus metrics, one registry per engine process-object (tests run several engines)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .vllm_metrics import PrefixCacheCounts, VllmCollector

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ..engine import Engine, EngineStats, GenerationResult

class ModelRecord(Protocol):
    """What the metrics read of one model of a process (``serving.ModelEntry``): a protocol,
    so this layer, which ``serving/`` imports, does not import the pool back."""

    name: str
    engine: Engine | None
    state: str
    users: int
    loads: int
    wakes: int
    sleeps: int
    evictions: int
    last_load_s: float | None
    last_wake_s: float | None


class ModelsView(Protocol):
    """The models of a process as the metrics read them (``serving.ModelPool``)."""

    strict: bool  # several models by name: rows are labelled model_name

    def entries(self) -> Sequence[ModelRecord]: ...

    def loaded(self) -> Iterable[tuple[ModelRecord, Engine]]: ...


# Base units (seconds), the old millisecond buckets' bounds.
_S_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter("hydra_http_requests", "HTTP requests", ["route", "status"], registry=r)
        self.rpc_requests = Counter("hydra_rpc_requests", "RPC requests", ["op", "status"], registry=r)
        self.rpc_bytes_in = Counter("hydra_rpc_payload_bytes_in", "RPC payload bytes received", registry=r)
        self.rpc_bytes_out = Counter("hydra_rpc_payload_bytes_out", "RPC payload bytes sent", registry=r)
        self.rpc_connections = Gauge("hydra_rpc_connections", "open RPC connections", registry=r)
        self.rpc_peers_refused = Counter(
            "hydra_rpc_peers_refused", "RPC connections closed at accept: peer not in --rpc-allow", registry=r
        )
        self.http_auth_rejected = Counter(
            "hydra_http_auth_rejected", "HTTP requests refused 401: missing or wrong API key", registry=r
        )
        self.http_auth_forbidden = Counter(
            "hydra_http_auth_forbidden", "HTTP requests refused 403: a plain API key on an admin route", registry=r
        )
        self.completion_tokens = Counter("hydra_completion_tokens", "tokens generated", ["path"], registry=r)
        self.prompt_tokens = Counter("hydra_prompt_tokens", "prompt tokens evaluated", ["path"], registry=r)
        self.cached_prompt_tokens = Counter(
            "hydra_cached_prompt_tokens", "prompt tokens reused from the slot KV", ["path"], registry=r
        )
        self.pooled_inputs = Counter(
            "hydra_pooled_inputs", "embedding inputs and rerank pairs computed", ["path"], registry=r
        )
        self.ttft = Histogram(
            "hydra_ttft_seconds", "engine time to first token "
            "(slot claimed -> first token)", ["path"], buckets=_S_BUCKETS, registry=r
        )
        self.decode_requests = Counter("hydra_decode_requests", "decode requests by final state", ["state"], registry=r)
        self.decode_ack = Histogram(
            "hydra_decode_ack_seconds", "DECODE validate+restore+reply", buckets=_S_BUCKETS, registry=r
        )
        self.restore_bytes = Counter("hydra_restore_bytes", "KV bytes restored into slots", registry=r)
        self.cancel = Histogram(
            "hydra_cancel_seconds", "DELETE until the task stopped", buckets=_S_BUCKETS, registry=r
        )
        self.prefix_cache = PrefixCacheCounts()  # vllm:prefix_cache_* (vllm_metrics.py)
        # Several models (watch_models): each model's own, by name, kept across its unloads.
        self.by_model: dict[str, PrefixCacheCounts] | None = None

    def prefix_counts(self, model: str) -> PrefixCacheCounts:
        """The vLLM request figures of ``model`` (one process-wide set with one model)."""
        if self.by_model is None:
            return self.prefix_cache
        return self.by_model.setdefault(model, PrefixCacheCounts())

    def record_generation(
        self, path: str, res: GenerationResult, *, model: str = "", aborted: bool = False, queue_s: float = 0.0
    ) -> None:
        """One finished (or stopped) generation's token counts and latencies; ``queue_s``:
        how long it waited for its slot; ``model``: which model's (several models)."""
        self.completion_tokens.labels(path).inc(res.completion_tokens)
        self.prompt_tokens.labels(path).inc(res.n_prompt_processed)
        self.cached_prompt_tokens.labels(path).inc(res.n_common)
        self.prefix_counts(model).observe(res, aborted=aborted, queue_s=queue_s)
        self.ttft.labels(path).observe(res.prompt_ms / 1000.0)  # the engine's own: no slot wait

    def record_pooled(self, path: str, n_inputs: int, n_tokens: int) -> None:
        """One embedding or rerank request's inputs and their tokens (prompt tokens of ``path``)."""
        self.pooled_inputs.labels(path).inc(n_inputs)
        self.prompt_tokens.labels(path).inc(n_tokens)

    def live_gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A gauge read at scrape time from engine state (no bookkeeping to drift)."""
        Gauge(name, doc, registry=self.registry).set_function(read)

    def watch_models(
        self, pool: ModelsView, rpc_engine: Engine, running_decodes: Callable[[], int], block_size: int = 16
    ) -> None:
        """Gauges read from the engines (and the decode requests) at scrape time: every
        model's, labelled ``model_name`` when the process serves several (vLLM's label), its
        state and what its loads cost; ``block_size``: the KV block vllm:cache_config_info
        (the RPC model's cache) counts in."""
        labelled = pool.strict
        if labelled:
            self.by_model = {}

        def models() -> list[tuple[str, Engine | None, PrefixCacheCounts]]:
            if not labelled:
                return [(rpc_engine.served_name, rpc_engine, self.prefix_cache)]
            return [(e.name, e.engine, self.prefix_counts(e.name)) for e in pool.entries()]

        def engines() -> list[tuple[str | None, Engine]]:
            return [(e.name if labelled else None, engine) for e, engine in pool.loaded()]

        self.registry.register(VllmCollector(models, lambda: rpc_engine, block_size))
        if rpc_engine.stats().prompt_cache is not None:  # --cache-ram-mib: the cache is there from the start
            self.registry.register(PromptCacheCollector(engines))
        self.registry.register(EngineCollector(engines))
        if labelled:
            self.registry.register(ModelPoolCollector(pool))
        g = self.live_gauge
        g("hydra_decode_requests_running", "decode requests not yet ended", running_decodes)
        # A leak check for soaks: every task of this process's trio run, read at scrape time
        # (from the /metrics handler, inside the run).
        g("hydra_trio_tasks", "tasks in the trio run (leak check)", trio_task_count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# (family, name, doc, read): gauges, and counters of figures that only grow (exported as
# ``NAME_total``, so rate() and resets work on them; they show work done after a cancel too).
_Family = type[GaugeMetricFamily] | type[CounterMetricFamily]
_G, _C = GaugeMetricFamily, CounterMetricFamily
_ENGINE_FIGURES: tuple[tuple[_Family, str, str, Callable[[EngineStats], float]], ...] = (
    (_G, "hydra_slots_busy", "slots claimed by a request", lambda s: s.slots_busy),
    (_G, "hydra_slots_total", "slots", lambda s: s.slots),
    (_G, "hydra_kv_cells_used", "KV positions held by all slots", lambda s: s.kv_cells_used),
    (_G, "hydra_kv_cells_total", "KV cells shared by all slots", lambda s: s.kv_cells_total),
    (_G, "hydra_step_batch_mean_size", "mean number of sequences per generation step",
     lambda s: s.step_batch_mean_size),
    (_G, "hydra_model_load_seconds", "model load time", lambda s: s.model_load_s),
    (_C, "hydra_gpu_worker_busy_seconds", "time the GPU worker spent in llama.cpp calls", lambda s: s.worker_busy_s),
    (_C, "hydra_gpu_worker_calls", "llama.cpp calls made on the GPU worker", lambda s: s.worker_calls),
    (_C, "hydra_llama_decode_seconds",
     "time inside llama_decode, the model's compute (the rest of the worker's busy time is the engine's)",
     lambda s: s.llama_decode_s),
    (_C, "hydra_step_batches", "batched generation steps", lambda s: s.step_batches),
    (_C, "hydra_engine_tokens_generated", "tokens sampled by the engine (all paths)", lambda s: s.tokens_generated),
    (_C, "hydra_engine_prompt_tokens_processed", "prompt tokens evaluated by the engine (all paths)",
     lambda s: s.prompt_tokens_processed),
    (_C, "hydra_engine_step_tokens", "tokens evaluated by batched generation steps", lambda s: s.step_tokens),
    (_C, "hydra_engine_step_prompt_tokens", "prompt tokens evaluated inside generation-step batches (chunked prefill)",
     lambda s: s.step_prompt_tokens),
    (_C, "hydra_engine_tokens_evaluated", "prompt + step tokens evaluated by llama.cpp", lambda s: s.tokens_evaluated),
)


# The engines a scrape reads: (model name, engine) of each serving model; the name is None
# when the process serves one model (its figures then carry no label, as always).
Engines = Callable[[], "list[tuple[str | None, Engine]]"]


def _labelled(
    family: _Family, name: str, doc: str, extra: list[str], rows: list[tuple[str | None, list[str], float]]
) -> Metric:
    """One family with a sample per (model, extra label values, value) row: ``model_name``
    leads the labels when the rows name models."""
    named = any(model is not None for model, _, _ in rows)
    f = family(name, doc, labels=(["model_name"] if named else []) + extra)
    for model, values, value in rows:
        f.add_metric(([model] if named and model is not None else []) + values, value)
    return f


class EngineCollector(Collector):
    """Each engine's figures from one ``Engine.stats()`` snapshot per scrape (no
    bookkeeping here to drift)."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        snaps = [(model, engine.stats()) for model, engine in self.engines()]
        for family, name, doc, read in _ENGINE_FIGURES:
            yield _labelled(family, name, doc, [], [(model, [], read(stats)) for model, stats in snaps])
        yield _labelled(
            GaugeMetricFamily,
            "hydra_step_decode_seconds",
            "a generation step's llama_decode, mean of the recent ones with this many rows (streams' tokens and draft "
            "positions)",
            ["rows"],
            [(model, [str(rows)], seconds) for model, stats in snaps for rows, seconds in stats.step_decode_s],
        )
        yield from _chunking_figures(snaps)
        yield from _session_figures(snaps)


def _chunking_figures(snaps: list[tuple[str | None, EngineStats]]) -> Iterator[Metric]:
    """How a prompt part beside running streams is sized (engine/sched/chunks.py): the ITL
    target in force and what it is sized from, each once measured (absent before)."""
    for name, doc, read in (
        ("hydra_itl_target_seconds", "the inter-token latency target prompt parts beside running streams are sized "
         "for (--itl-target-ms, or the machine's own once measured)", lambda c: c.itl_target_s),
        ("hydra_one_stream_step_seconds", "a step of one stream and no prompt tokens, as measured lately",
         lambda c: c.one_stream_step_s),
        ("hydra_prompt_token_seconds", "what a prompt token adds to a step beside running streams, as measured lately",
         lambda c: c.prompt_token_s),
        ("hydra_prompt_part_floor_tokens", "the fewest prompt tokens a step beside running streams carries once "
         "measured", lambda c: c.part_floor_tokens),
    ):
        rows = [
            (model, [], float(value))
            for model, stats in snaps
            if stats.chunking is not None and (value := read(stats.chunking)) is not None
        ]
        if rows:
            yield _labelled(_G, name, doc, [], rows)


def _session_figures(snaps: list[tuple[str | None, EngineStats]]) -> Iterator[Metric]:
    """Agent sessions (docs/operations.md, "Agent sessions") and the evictions of every tier
    by the kind of history they dropped, each engine's (``model_name`` with several)."""
    live = [(model, s) for model, stats in snaps if (s := stats.sessions) is not None]
    if live:
        for family, name, doc, read in (
            (_G, "hydra_sessions", "agent sessions held (scoped by tenant and cache_salt)", lambda s: s.sessions),
            (_G, "hydra_session_turns_live", "requests running in an agent session", lambda s: s.live_turns),
            (_C, "hydra_session_turns_cut", "turns cut by their deadline, their tree's finish or their parent's "
             "cancellation", lambda s: s.turns_cut),
            (_C, "hydra_session_trees_finished", "POST /finish_session "
             "calls that ended a tree", lambda s: s.trees_finished),
        ):
            yield _labelled(family, name, doc, [], [(model, [], read(s)) for model, s in live])
    yield _labelled(
        _C,
        "hydra_kv_evictions",
        "KV histories evicted for room, by tier (slot, ram, disk) and kind (finished, one_off, expired, live)",
        ["tier", "kind"],
        [(model, [tier, kind], n) for model, stats in snaps for tier, kind, n in stats.evictions],
    )
    disks = [(model, d) for model, stats in snaps if (d := stats.disk) is not None]
    if not disks:
        return
    for family, name, doc, read in (
        (_G, "hydra_disk_cache_bytes", "bytes the disk tier's entries hold (--cache-disk)", lambda d: d.nbytes),
        (_G, "hydra_disk_cache_entries", "histories held by the disk tier", lambda d: d.entries),
        (_C, "hydra_disk_cache_written", "histories RAM dropped, written to disk", lambda d: d.written),
        (_C, "hydra_disk_cache_loaded", "disk entries restored into a slot", lambda d: d.loaded),
        (_C, "hydra_disk_cache_loaded_tokens", "positions restored from disk (not recomputed)",
         lambda d: d.loaded_tokens),
        (_C, "hydra_disk_cache_rejected", "disk entries that failed a check when read (never restored)",
         lambda d: d.rejected),
        (_C, "hydra_disk_cache_dropped", "histories RAM dropped that were not written (the write queue was full)",
         lambda d: d.dropped),
        (_C, "hydra_disk_cache_cleaned",
         "files removed at start (unfinished writes, torn, another model's, over the bound)", lambda d: d.cleaned),
        (_C, "hydra_disk_cache_prefetched",
         "disk entries brought back to RAM ahead of their turn (while it waited for a slot, or its tool ran)",
         lambda d: d.prefetched),
    ):
        yield _labelled(family, name, doc, [], [(model, [], read(d)) for model, d in disks])


class PromptCacheCollector(Collector):
    """The host-memory prompt cache (--cache-ram-mib) of each engine, read at scrape time."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        caches = [(model, c) for model, engine in self.engines() if (c := engine.stats().prompt_cache) is not None]
        if not caches:
            return
        for family, name, doc, read in (
            (_G, "hydra_prompt_cache_bytes", "host memory held by the prompt cache", lambda c: c.nbytes),
            (_G, "hydra_prompt_cache_entries", "slot histories held by the prompt cache", lambda c: c.entries),
            (_G, "hydra_prompt_cache_shared_bytes",
             "of the prompt cache's bytes, heads held once for histories that start alike", lambda c: c.shared_bytes),
            (_C, "hydra_prompt_cache_saved", "slot histories copied into the prompt cache", lambda c: c.saved),
            (_C, "hydra_prompt_cache_restored", "prompt cache entries restored into a slot", lambda c: c.restored),
            (_C, "hydra_prompt_cache_restored_tokens", "positions restored from the prompt cache (not recomputed)",
             lambda c: c.restored_tokens),
            (_C, "hydra_prompt_cache_evicted", "prompt cache entries dropped for room or replaced by a longer one",
             lambda c: c.evicted),
        ):
            yield _labelled(family, name, doc, [], [(model, [], read(c)) for model, c in caches])


class ModelPoolCollector(Collector):
    """Several models: each one's state (1 for the state it is in), what its loads and
    wakes cost, how often it was evicted or put to sleep, and the requests holding it."""

    def __init__(self, pool: ModelsView) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        entries = self.pool.entries()
        states = ("loaded", "loading", "unloaded", "sleeping")
        yield _labelled(_G, "hydra_model_state", "1 for the state each model is in", ["state"],
                        [(e.name, [s], float(e.state == s)) for e in entries for s in states])
        for family, name, doc, read in (
            (_G, "hydra_model_requests", "requests holding the model now (it is not unloaded under them)",
             lambda e: e.users),
            (_C, "hydra_model_loads", "cold loads of the model", lambda e: e.loads),
            (_C, "hydra_model_wakes", "wakes of the model from sleep", lambda e: e.wakes),
            (_C, "hydra_model_sleeps", "times the model was put to sleep (--sleep-idle-seconds)", lambda e: e.sleeps),
            (_C, "hydra_model_evictions", "times the model was evicted for another (--models-max)",
             lambda e: e.evictions),
            (_G, "hydra_model_last_load_seconds", "the model's last cold load, 0 before one",
             lambda e: e.last_load_s or 0.0),
            (_G, "hydra_model_last_wake_seconds", "the model's last wake, 0 before one",
             lambda e: e.last_wake_s or 0.0),
        ):
            yield _labelled(family, name, doc, [], [(e.name, [], float(read(e))) for e in entries])


def trio_task_count() -> float:
    """Tasks in the current trio run; -1 outside one."""
    try:
        root = trio.lowlevel.current_root_task()
    except RuntimeError:
        return -1.0
    if root is None:
        return -1.0

    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)

    return float(walk(root))
