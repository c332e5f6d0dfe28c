"""Prometheus metrics, one registry per engine process-object (tests run several engines)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

_MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)


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
        self.completion_tokens = Counter("hydra_completion_tokens", "tokens generated", ["path"], registry=r)
        self.prompt_tokens = Counter("hydra_prompt_tokens", "prompt tokens evaluated", ["path"], registry=r)
        self.cached_prompt_tokens = Counter(
            "hydra_cached_prompt_tokens", "prompt tokens reused from the slot KV", ["path"], registry=r
        )
        self.ttft_ms = Histogram("hydra_ttft_ms", "time to first token", ["path"], buckets=_MS_BUCKETS, registry=r)
        self.decode_requests = Counter("hydra_decode_requests", "decode requests by final state", ["state"], registry=r)
        self.decode_ack_ms = Histogram(
            "hydra_decode_ack_ms", "DECODE validate+restore+reply", buckets=_MS_BUCKETS, registry=r
        )
        self.restore_bytes = Counter("hydra_restore_bytes", "KV bytes restored into slots", registry=r)
        self.cancel_ms = Histogram("hydra_cancel_ms", "DELETE until the task stopped", buckets=_MS_BUCKETS, registry=r)

    def add_live(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A gauge read at scrape time from engine state (no bookkeeping to drift)."""

        class _Live:
            def collect(self) -> list[GaugeMetricFamily]:
                g = GaugeMetricFamily(name, doc)
                g.add_metric([], float(read()))
                return [g]

        self.registry.register(_Live())

    def render(self) -> bytes:
        return generate_latest(self.registry)
