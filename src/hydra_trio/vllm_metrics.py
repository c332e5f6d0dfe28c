"""vLLM's metric names on /metrics, for routers and autoscalers that read them (llm-d, the
vLLM production stack, KEDA rules): ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` and the token counters
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``.

prometheus-client accepts ':' in metric names (it is legal in the exposition format; the
Prometheus docs reserve it for recording rules, and vLLM uses it anyway), so these are
ordinary metric families, rendered as vLLM renders them (counters with ``_total``), with
vLLM's labels: ``engine="0"`` (one engine per process: vllm-router counts distinct
``engine`` labels to size data parallelism) and ``model_name``. Every value is read from
the engine at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .engine.engine import Engine, GenerationResult


class PrefixCacheCounts:
    """Prompt tokens looked up in slot KV (queries) and found there (hits), per request,
    as vLLM counts them: in tokens, not requests."""

    def __init__(self) -> None:
        self.queries = 0
        self.hits = 0

    def observe(self, res: GenerationResult) -> None:
        self.queries += res.prompt_tokens
        self.hits += res.n_common


class VllmCollector(Collector):
    def __init__(self, engine: Engine, prefix: PrefixCacheCounts) -> None:
        self.engine = engine
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        labels = ["engine", "model_name"]
        model = ["0", engine.identity.model_alias]
        slots = engine.slots
        # A request runs from its slot claim to its release (prefill, generation, export copy).
        running = sum(1 for s in slots.slots if s.busy)
        # KV held by running requests, of all cells; an idle slot's KV is a prefix cache that
        # make_room() evicts on demand, as vLLM counts its cached-but-free blocks as free.
        held = sum(engine.n_past(s.id) for s in slots.slots if s.busy)
        families: list[Metric] = []
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", slots.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", min(1.0, held / engine.n_ctx)),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(model, value)
            families.append(g)
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", self.prefix.queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", self.prefix.hits),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(model, value)
            families.append(c)
        yield from families
