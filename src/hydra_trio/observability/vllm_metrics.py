"""vLLM's metric names on /metrics, for routers, autoscalers and dashboards that read them
(llm-d, the vLLM production stack, KEDA rules): ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, the token counters
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``, ``vllm:prompt_tokens`` /
``vllm:generation_tokens``, ``vllm:request_success{finished_reason}``, and the latency
histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` and
``vllm:e2e_request_latency_seconds`` (vLLM's buckets, with finer ones below 10 ms for
inter-token latency, which a small model reaches), the phases of a request:
``vllm:request_queue_time_seconds`` (waiting for a slot), ``vllm:request_prefill_time_seconds``
(slot claimed -> first token) and ``vllm:request_decode_time_seconds`` (first -> last token).
TTFT and e2e count from the request's arrival, so they include the queue time, as vLLM's do.
With LoRA adapters loaded, ``vllm:lora_requests_info``: the adapters requests run under and
wait for (``lora_requests_info``). And ``vllm:cache_config_info``, an info gauge (value 1) whose labels say how the KV
cache is cut into blocks, as vLLM's CacheConfig labels it: ``block_size`` (the KV events' block,
--kv-events-block-size), ``num_gpu_blocks`` (all slots' cells in those blocks: what llm-d's
scheduler and the Inference Extension size an endpoint's cache by), ``num_cpu_blocks``
("None": the host prompt cache is sized in bytes, its entries' size varies by model),
``cache_dtype`` and ``enable_prefix_caching``.

prometheus-client accepts ':' in metric names (it is legal in the exposition format; the
Prometheus docs reserve it for recording rules, and vLLM uses it anyway), so these are
ordinary metric families, rendered as vLLM renders them (counters with ``_total``), with
vLLM's labels: ``engine="0"`` (one engine per process: vllm-router counts distinct
``engine`` labels to size data parallelism) and ``model_name`` (a sample per model when the
process serves several: serving/model_pool.py). Every value is read from the engines at scrape time.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ..engine import Engine, GenerationResult


TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
PHASE_BUCKETS = E2E_BUCKETS  # vLLM uses its request-latency buckets for queue, prefill and decode too


class Buckets:
    """A histogram's counts, kept by the engine and rendered at scrape time (one request's
    inter-token gaps go in at once: no lock or metric call per token)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, values: Iterable[float]) -> None:
        bounds, counts = self.bounds, self.counts
        for v in values:
            counts[bisect_left(bounds, v)] += 1  # le=b holds v <= b
            self.sum += v

    def add_to(self, h: HistogramMetricFamily, label_values: list[str]) -> None:
        """These counts as ``h``'s sample with ``label_values`` (a family holds one per model)."""
        cumulative, total = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            cumulative.append((bound, total))
        h.add_metric(label_values, cumulative, self.sum)


class PrefixCacheCounts:
    """What vLLM counts per finished request: prompt tokens looked up in slot KV (queries)
    and found there (hits), in tokens; prompt and generated tokens; requests by finish
    reason; and the latency histograms."""

    def __init__(self) -> None:
        self.queries = 0
        self.hits = 0
        self.prompt_tokens = 0  # evaluated (vllm:prompt_tokens counts prefilled tokens)
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()
        self.ttft = Buckets(TTFT_BUCKETS)
        self.itl = Buckets(ITL_BUCKETS)
        self.e2e = Buckets(E2E_BUCKETS)
        self.queue = Buckets(PHASE_BUCKETS)
        self.prefill = Buckets(PHASE_BUCKETS)
        self.decode = Buckets(PHASE_BUCKETS)

    def observe(self, res: GenerationResult, *, aborted: bool = False, queue_s: float = 0.0) -> None:
        """``queue_s``: how long the request waited for its slot (0 for a DECODE, which names
        its slot and is refused when that is busy)."""
        self.queries += res.prompt_tokens
        self.hits += res.n_common
        self.prompt_tokens += res.n_prompt_processed
        self.generation_tokens += res.completion_tokens
        self.finished["abort" if aborted else res.finish_reason] += 1
        self.queue.observe((queue_s,))
        if res.first_token_at is not None:  # a request stopped before its first token has neither
            prefill_s, decode_s = res.prompt_ms / 1000.0, res.decode_ms / 1000.0
            self.ttft.observe((queue_s + prefill_s,))
            self.e2e.observe((queue_s + prefill_s + decode_s,))
            self.prefill.observe((prefill_s,))
            self.decode.observe((decode_s,))
        self.itl.observe(res.token_gaps_s)


# What a scrape reads of each model: its name, its engine (None: not loaded now) and its
# request figures.
Models = Callable[[], Sequence[tuple[str, "Engine | None", PrefixCacheCounts]]]


class VllmCollector(Collector):
    """vLLM's families, one sample per model (``model_name``); ``cache_engine``: the engine
    whose KV cache ``vllm:cache_config_info`` describes (the RPC model's)."""

    def __init__(self, models: Models, cache_engine: Callable[[], Engine], block_size: int = 16) -> None:
        self.models = models
        self.cache_engine = cache_engine
        self.block_size = block_size

    def cache_config_info(self, engine: Engine) -> GaugeMetricFamily:
        """vLLM's info gauge: the cache's shape in labels (read at each scrape: T2 may
        change n_ctx, T3 the cache type)."""
        info = {
            "block_size": str(self.block_size),
            "cache_dtype": str(engine.kv_cache_layout.get("type_k", "auto")),
            "enable_prefix_caching": "True",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(engine.stats().kv_cells_total // self.block_size),
            "engine": "0",
        }
        f = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info))
        f.add_metric(list(info.values()), 1.0)
        return f

    def lora_requests_info(self) -> GaugeMetricFamily | None:
        """vLLM's LoRA gauge, which the Gateway API Inference Extension and llm-d route on:
        its value the time of the scrape, its labels the adapters requests run under and wait
        for (names, comma-joined) and ``max_lora``, the most adapters one batch applies (here
        all those loaded: a batch runs one set, which may hold each). None: no adapters."""
        adapters = self.cache_engine().adapters  # --lora applies to the default (RPC) model
        if not len(adapters):
            return None
        running, waiting = adapters.in_use()
        labels = {
            "max_lora": str(len(adapters)),
            "running_lora_adapters": ",".join(running),
            "waiting_lora_adapters": ",".join(waiting),
        }
        f = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.", labels=list(labels))
        f.add_metric(list(labels.values()), time.time())
        return f

    def collect(self) -> Iterator[Metric]:
        labels = ["engine", "model_name"]
        rows = [(["0", name], engine.stats() if engine is not None else None, p) for name, engine, p in self.models()]
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        for family, name, doc, value in (
            (gauge, "vllm:num_requests_running", "Number of requests in model execution batches.", lambda s,
             p: s.slots_busy if s else 0),
            (gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda s,
             p: s.requests_waiting if s else 0),
            (gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda s,
             p: s.kv_cache_usage if s else 0.0),
            (counter, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             lambda s, p: p.queries),
            (counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", lambda s,
             p: p.hits),
            (counter, "vllm:prompt_tokens", "Number of prefill tokens processed.", lambda s, p: p.prompt_tokens),
            (counter, "vllm:generation_tokens", "Number of generation tokens processed.", lambda s,
             p: p.generation_tokens),
            (counter, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", lambda s,
             p: s.spec_drafts if s else 0),
            (counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", lambda s,
             p: s.spec_draft_tokens if s else 0),
            (counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", lambda s,
             p: s.spec_accepted_tokens if s else 0),
        ):
            f = family(name, doc, labels=labels)
            for model, stats, p in rows:
                f.add_metric(model, value(stats, p))
            yield f
        done = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.", labels=[*labels, "finished_reason"]
        )
        for model, _stats, p in rows:
            for reason in ("stop", "length", "abort"):
                done.add_metric([*model, reason], p.finished[reason])
        yield done
        yield self.cache_config_info(self.cache_engine())
        if (lora := self.lora_requests_info()) is not None:
            yield lora
        for attr, name, doc in (
            ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
            ("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
            ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
            ("queue", "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
            ("prefill", "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
            ("decode", "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
        ):
            h = HistogramMetricFamily(name, doc, labels=labels)
            for model, _stats, p in rows:
                getattr(p, attr).add_to(h, model)
            yield h
