"""Prometheus metrics, one registry per engine process-object (tests run several engines)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .vllm_metrics import PrefixCacheCounts, VllmCollector

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .engine import Engine, EngineStats, GenerationResult

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
        self.ttft = Histogram(
            "hydra_ttft_seconds", "engine time to first token (slot claimed -> first token)", ["path"], buckets=_S_BUCKETS, registry=r
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

    def record_generation(self, path: str, res: GenerationResult, *, aborted: bool = False, queue_s: float = 0.0) -> None:
        """One finished (or stopped) generation's token counts and latencies; ``queue_s``:
        how long it waited for its slot."""
        self.completion_tokens.labels(path).inc(res.completion_tokens)
        self.prompt_tokens.labels(path).inc(res.n_prompt_processed)
        self.cached_prompt_tokens.labels(path).inc(res.n_common)
        self.prefix_cache.observe(res, aborted=aborted, queue_s=queue_s)
        self.ttft.labels(path).observe(res.prompt_ms / 1000.0)  # the engine's own: no slot wait

    def live_gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A gauge read at scrape time from engine state (no bookkeeping to drift)."""
        Gauge(name, doc, registry=self.registry).set_function(read)

    def watch_engine(self, engine: Engine, running_decodes: Callable[[], int], block_size: int = 16) -> None:
        """Gauges read from the engine (and the decode requests) at scrape time;
        ``block_size``: the KV block vllm:cache_config_info counts in."""
        self.registry.register(VllmCollector(engine, self.prefix_cache, block_size))
        if engine.stats().prompt_cache is not None:  # --cache-ram-mib: the cache is there from the start
            self.registry.register(PromptCacheCollector(engine))
        self.registry.register(EngineCollector(engine))
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
    (_G, "hydra_step_batch_mean_size", "mean number of sequences per generation step", lambda s: s.step_batch_mean_size),
    (_G, "hydra_model_load_seconds", "model load time", lambda s: s.model_load_s),
    (_C, "hydra_gpu_worker_busy_seconds", "time the GPU worker spent in llama.cpp calls", lambda s: s.worker_busy_s),
    (_C, "hydra_gpu_worker_calls", "llama.cpp calls made on the GPU worker", lambda s: s.worker_calls),
    (_C, "hydra_llama_decode_seconds", "time inside llama_decode, the model's compute (the rest of the worker's busy time is the engine's)", lambda s: s.llama_decode_s),
    (_C, "hydra_step_batches", "batched generation steps", lambda s: s.step_batches),
    (_C, "hydra_engine_tokens_generated", "tokens sampled by the engine (all paths)", lambda s: s.tokens_generated),
    (_C, "hydra_engine_prompt_tokens_processed", "prompt tokens evaluated by the engine (all paths)", lambda s: s.prompt_tokens_processed),
    (_C, "hydra_engine_step_tokens", "tokens evaluated by batched generation steps", lambda s: s.step_tokens),
    (_C, "hydra_engine_step_prompt_tokens", "prompt tokens evaluated inside generation-step batches (chunked prefill)", lambda s: s.step_prompt_tokens),
    (_C, "hydra_engine_tokens_evaluated", "prompt + step tokens evaluated by llama.cpp", lambda s: s.tokens_evaluated),
)


class EngineCollector(Collector):
    """The engine's figures from one ``Engine.stats()`` snapshot per scrape (no
    bookkeeping here to drift)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        for family, name, doc, read in _ENGINE_FIGURES:
            yield family(name, doc, value=read(stats))
        by_rows = GaugeMetricFamily(
            "hydra_step_decode_seconds",
            "a generation step's llama_decode, mean of the recent ones with this many rows (streams' tokens and draft positions)",
            labels=["rows"],
        )
        for rows, seconds in stats.step_decode_s:
            by_rows.add_metric([str(rows)], seconds)
        yield by_rows
        yield from _session_figures(stats)


def _session_figures(stats: EngineStats) -> Iterator[Metric]:
    """Agent sessions (docs/operations.md, "Agent sessions") and the evictions of every tier
    by the kind of history they dropped."""
    s = stats.sessions
    if s is not None:
        yield GaugeMetricFamily("hydra_sessions", "agent sessions held (scoped by tenant and cache_salt)", value=s.sessions)
        yield GaugeMetricFamily("hydra_session_turns_live", "requests running in an agent session", value=s.live_turns)
        yield CounterMetricFamily("hydra_session_turns_cut", "turns cut by their deadline, their tree's finish or their parent's cancellation", value=s.turns_cut)
        yield CounterMetricFamily("hydra_session_trees_finished", "POST /finish_session calls that ended a tree", value=s.trees_finished)
    evicted = CounterMetricFamily(
        "hydra_kv_evictions", "KV histories evicted for room, by tier (slot, ram, disk) and kind (finished, one_off, expired, live)",
        labels=["tier", "kind"],
    )
    for tier, kind, n in stats.evictions:
        evicted.add_metric([tier, kind], n)
    yield evicted
    d = stats.disk
    if d is None:
        return
    yield GaugeMetricFamily("hydra_disk_cache_bytes", "bytes the disk tier's entries hold (--cache-disk)", value=d.nbytes)
    yield GaugeMetricFamily("hydra_disk_cache_entries", "histories held by the disk tier", value=d.entries)
    for name, doc, value in (
        ("hydra_disk_cache_written", "histories RAM dropped, written to disk", d.written),
        ("hydra_disk_cache_loaded", "disk entries restored into a slot", d.loaded),
        ("hydra_disk_cache_loaded_tokens", "positions restored from disk (not recomputed)", d.loaded_tokens),
        ("hydra_disk_cache_rejected", "disk entries that failed a check when read (never restored)", d.rejected),
        ("hydra_disk_cache_dropped", "histories RAM dropped that were not written (the write queue was full)", d.dropped),
        ("hydra_disk_cache_cleaned", "files removed at start (unfinished writes, torn, another model's, over the bound)", d.cleaned),
        ("hydra_disk_cache_prefetched", "disk entries brought back to RAM ahead of their turn (while it waited for a slot, or its tool ran)", d.prefetched),
    ):
        yield CounterMetricFamily(name, doc, value=value)


class PromptCacheCollector(Collector):
    """The host-memory prompt cache (--cache-ram-mib), read at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        c = self.engine.stats().prompt_cache
        if c is None:
            return
        yield GaugeMetricFamily("hydra_prompt_cache_bytes", "host memory held by the prompt cache", value=c.nbytes)
        yield GaugeMetricFamily("hydra_prompt_cache_entries", "slot histories held by the prompt cache", value=c.entries)
        for name, doc, value in (
            ("hydra_prompt_cache_saved", "slot histories copied into the prompt cache", c.saved),
            ("hydra_prompt_cache_restored", "prompt cache entries restored into a slot", c.restored),
            ("hydra_prompt_cache_restored_tokens", "positions restored from the prompt cache (not recomputed)", c.restored_tokens),
            ("hydra_prompt_cache_evicted", "prompt cache entries dropped for room or replaced by a longer one", c.evicted),
        ):
            yield CounterMetricFamily(name, doc, value=value)


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
